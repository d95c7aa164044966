"""The refresh round's release at the server's points: a binning trap (Fowl et al., "Robbing the Fed",
ICLR 2022) rebuilds training images from the exact release, and none from the private one (the default);
the private release's sensitivity and its accountant, checked independently."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import fit_artifact

import posterior_fusion
from posterior_fusion.artifact import load_client, write_client_artifact, write_global_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.local.privacy import training
from posterior_fusion.local.refresh import TRUST_RADIUS, distance_from_own_posterior, refresh
from posterior_fusion.local.refresh_settings import PRIVATE_REFRESH, RefreshPrivacy
from posterior_fusion.posterior import GlobalEnsemble

HIDDEN = 192  # the trap's thresholds: one hidden unit each


@pytest.fixture(scope="module")
def trap_setting(tmp_path_factory, small_silo):
    """A silo of 64 images (7 x 7), its one-component MLP artifact (hidden = HIDDEN units, diag), and the
    server's binning trap for that model: every hidden unit reads the mean brightness, unit j fires above its
    own threshold t_j (evenly spaced over the brightness range), the output layer weighs every unit alike with
    a class-dependent weight."""
    folder = tmp_path_factory.mktemp("trap")
    silo = SiloData(small_silo.x[:64, ::4, ::4].copy(), small_silo.y[:64], "fmnist", 10)
    fit_artifact(folder / "c.h5", silo, "diag", kwargs={"in_features": 49, "hidden": HIDDEN}, mixtures=1, epochs=1)
    source = load_client(folder / "c.h5")
    x, _ = silo.tensors()
    brightness = x.reshape(64, -1).mean(1)
    lo, hi = float(brightness.min()) - 1e-3, float(brightness.max()) + 1e-3
    thresholds = torch.linspace(lo, hi, HIDDEN)
    w1 = torch.full((HIDDEN, 49), 1.0 / 49)
    b1 = -thresholds
    w2 = torch.linspace(-0.5, 0.5, 10)[:, None].expand(10, HIDDEN).contiguous() / HIDDEN
    b2 = torch.zeros(10)
    trap = torch.cat([w1.reshape(-1), b1, w2.reshape(-1), b2])
    at = GlobalEnsemble(str(folder / "g.h5"), "1" * 64, source.model_spec, source.layout, {"method": "fedavg"}, (trap,))
    return silo, source, at, thresholds


def recovered_images(source, comp, at) -> torch.Tensor:
    """What the server rebuilds from one refreshed component: the silo's summed gradient at its point from
    the released centre and precision (Λ_d (w − ŵ) = g/T + λ0 w), then the difference of adjacent units'
    weight and bias gradients, ``(HIDDEN − 1, 49)`` candidate images."""
    w = at.members[0].double()
    lam = comp.curvature.astype(torch.float64).precision(comp.temperature, comp.prior_precision)
    g = comp.temperature * (lam.matvec(w - comp.map.double()) - comp.prior_precision * w)
    gw, gb = g[: HIDDEN * 49].reshape(HIDDEN, 49), g[HIDDEN * 49: HIDDEN * 50]
    dw, db = gw[:-1] - gw[1:], gb[:-1] - gb[1:]
    keep = db.abs() > 1e-6 * db.abs().max()
    return dw[keep] / db[keep, None]


def count_rebuilt(images: torch.Tensor, silo: SiloData) -> int:
    """Training images some candidate matches within half a grey level everywhere (in the model's input
    units: the transform's step for one level of the stored 8-bit images)."""
    x, _ = silo.tensors()
    step = float((x.max() - x.min()) / float(silo.x.max() - silo.x.min()))
    if len(images) == 0:
        return 0
    worst = (x.reshape(len(x), -1).double()[:, None, :] - images[None]).abs().amax(-1)  # (n, candidates)
    return int((worst.amin(1) < 0.5 * step).sum())


def test_a_binning_trap_rebuilds_images_from_the_exact_release_and_none_from_the_private_one(trap_setting):
    """The trap lies within the default trust radius (the silo accepts it); the exact refresh (``refresh_dp_epsilon``
    none) hands it training images to within half a grey level; the default private refresh hands it none."""
    silo, source, at, _ = trap_setting
    assert distance_from_own_posterior(source, at.members[0]) <= TRUST_RADIUS
    _, exact = refresh(source, silo, at, "diag", log=lambda m: None, damping=1.0,
                         privacy=RefreshPrivacy(refresh_dp_epsilon=None))
    rebuilt = count_rebuilt(recovered_images(source, exact[0], at), silo)
    assert rebuilt >= 10, rebuilt  # the attack works on the exact release
    meta, private = refresh(source, silo, at, "diag", log=lambda m: None)
    assert meta["refreshed_at"]["dp"]["epsilon"] <= PRIVATE_REFRESH.refresh_dp_epsilon
    assert count_rebuilt(recovered_images(source, private[0], at), silo) == 0


def test_the_private_release_is_fresh_keeps_its_own_curvature_and_records_its_guarantee(trap_setting, tmp_path):
    """Two private rounds differ (fresh noise); each component's curvature is the silo's own, damped; the record
    survives writing and reading, ``inspect`` shows it and ``fuse`` reports it per client."""
    silo, source, at, _ = trap_setting
    _, first = refresh(source, silo, at, "diag", log=lambda m: None)
    meta, second = refresh(source, silo, at, "diag", log=lambda m: None)
    assert not torch.equal(first[0].map, second[0].map)
    n = int(source.metadata["n_data"])
    d = second[0].training["damping"]
    torch.testing.assert_close(second[0].curvature.diagonal(), source.components[0].curvature.damped(n, d).diagonal())
    assert second[0].training["gain_test"] == "not run" and second[0].training["curvature_from"] == 0
    write_client_artifact(tmp_path / "r.h5", source.model_spec, source.layout, meta, second)
    record = load_client(tmp_path / "r.h5").metadata["refreshed_at"]["dp"]
    assert record["releases"] == 1 and record["clip"] == PRIVATE_REFRESH.refresh_dp_clip and record["delta"] == pytest.approx(1 / n)
    shown = CliRunner().invoke(pfuse, ["inspect", str(tmp_path / "r.h5")])
    assert shown.exit_code == 0 and "refresh round: private" in shown.output, shown.output
    write_client_artifact(tmp_path / "r2.h5", source.model_spec, source.layout, meta, first)
    fused = CliRunner().invoke(pfuse, ["fuse", str(tmp_path / "r.h5"), str(tmp_path / "r2.h5"), "--method", "fedavg",
                                       "--out", str(tmp_path / "g.h5")])
    assert fused.exit_code == 0, fused.output
    provenance = posterior_fusion.load(tmp_path / "g.h5").metadata["provenance"]
    assert all(p["refresh_dp"]["epsilon"] == record["epsilon"] for p in provenance)


def test_the_clipped_gradient_sum_moves_by_at_most_its_clip_for_any_one_sample():
    """Adding or removing one sample — ordinary, or a worst case with a huge input and a wrong label — changes the
    released sum by at most ``refresh_dp_clip`` (L2); below the clip the sum is the plain gradient's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    x, y = torch.randn(20, 5, dtype=torch.float64), torch.randint(0, 3, (20,))
    clip = 0.3
    full = training.clipped_gradient_sum(model, x, y, clip, batch_size=6)
    for extra_x, extra_y in ((torch.randn(1, 5, dtype=torch.float64), torch.tensor([1])),
                             (1e4 * torch.ones(1, 5, dtype=torch.float64), torch.tensor([2]))):
        more = training.clipped_gradient_sum(model, torch.cat([x, extra_x]), torch.cat([y, extra_y]), clip, batch_size=6)
        assert float((more - full).norm()) <= clip * (1 + 1e-9)
    for i in range(len(x)):
        less = training.clipped_gradient_sum(model, torch.cat([x[:i], x[i + 1:]]), torch.cat([y[:i], y[i + 1:]]), clip)
        assert float((full - less).norm()) <= clip * (1 + 1e-9)
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    plain = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])
    torch.testing.assert_close(training.clipped_gradient_sum(model, x, y, 1e6), plain)


def test_the_recorded_epsilon_is_opacus_accountant_on_the_recorded_noise(trap_setting):
    """The refresh round's ε, recomputed by Opacus' RDPAccountant from the recorded noise multiplier and the number
    of releases, equals the recorded ε, which is within the target."""
    from opacus.accountants import RDPAccountant

    silo, source, at, _ = trap_setting
    two = GlobalEnsemble(at.path, at.sha256, at.model_spec, at.layout, {"method": "fedavg"},
                         (source.components[0].map, source.components[0].map))
    meta, _ = refresh(source, silo, two, "diag", log=lambda m: None,
                        privacy=RefreshPrivacy(refresh_dp_epsilon=3.0, refresh_dp_delta=1e-5))
    record = meta["refreshed_at"]["dp"]
    accountant = RDPAccountant()
    accountant.history = [(record["noise_multiplier"], 1.0, record["releases"])]
    assert record["releases"] == 2 and record["epsilon"] <= 3.0
    assert accountant.get_epsilon(delta=record["delta"]) == pytest.approx(record["epsilon"], rel=1e-9)
    assert record["epsilon"] > 2.9  # the noise is the smallest that meets the target, not more


def test_refreshing_a_private_artifact_or_another_structure_privately(tmp_path, trap_setting):
    """A private round refuses to capture another structure (one line naming the setting that would); the CLI
    reads ``none`` and refuses the refresh settings without ``--at``."""
    silo, source, at, _ = trap_setting
    from posterior_fusion.errors import ConfigError

    with pytest.raises(ConfigError, match="refresh_dp_epsilon"):
        refresh(source, silo, at, "diag+full", log=lambda m: None)
    write_silo(tmp_path / "s.h5", silo)
    write_global_artifact(tmp_path / "g.h5", source.model_spec, source.layout, {"method": "fedavg"},
                          [source.components[0].map])
    r = CliRunner().invoke(pfuse, ["recapture", "--artifact", source.path, "--data", str(tmp_path / "s.h5"),
                                   "--refresh-dp-epsilon", "2", "--out", str(tmp_path / "x.h5")])
    assert r.exit_code == 2 and "--refresh-dp-epsilon" in r.stderr and "Traceback" not in r.output
    r = CliRunner().invoke(pfuse, ["refresh", "--artifact", source.path, "--data", str(tmp_path / "s.h5"), "--at",
                                   str(tmp_path / "g.h5"), "--refresh-dp-epsilon", "none", "--out", str(tmp_path / "x.h5")])
    assert r.exit_code == 0 and "dp" not in load_client(tmp_path / "x.h5").metadata["refreshed_at"], r.output


def test_a_private_artifact_is_refreshed_only_privately_its_epsilon_composed(tmp_path, small_silo):
    """A ``fit-local --dp`` artifact: the exact refresh is refused in one line; the private one is taken (the silo
    cannot be checked by hash: a private fit releases none) and records the fit's ε plus its own."""
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.local.fit import fit_and_write
    from posterior_fusion.local.fit_config import DPConfig, FitConfig, TrainConfig
    from posterior_fusion.local.init import initial_weights
    from posterior_fusion.models import ModelSpec

    silo = SiloData(small_silo.x[:128, ::4, ::4].copy(), small_silo.y[:128], "fmnist", 10)
    spec = ModelSpec("mlp", {"in_features": 49, "hidden": 8})
    cfg = FitConfig(structure="diag", dp=DPConfig(dp_epsilon=4.0), train=TrainConfig(epochs=1, batch_size=32))
    fit_and_write(spec, silo, initial_weights(spec, 1, 0), cfg, tmp_path / "p.h5", {"init_seed": 0}, log=lambda m: None)
    source = load_client(tmp_path / "p.h5")
    at = GlobalEnsemble("g.h5", "2" * 64, source.model_spec, source.layout, {"method": "fedavg"},
                        (source.components[0].map,))
    with pytest.raises(ConfigError, match="differentially private"):
        refresh(source, silo, at, "diag", log=lambda m: None, privacy=RefreshPrivacy(refresh_dp_epsilon=None))
    meta, comps = refresh(source, silo, at, "diag", log=lambda m: None)
    record = meta["refreshed_at"]["dp"]
    assert record["epsilon_with_fit"] == pytest.approx(record["epsilon"] + source.metadata["dp"]["epsilon"])
    assert len(comps) == 1 and torch.isfinite(comps[0].map).all()


def test_the_refresh_round_is_refused_under_its_memory_budget_before_any_work(tmp_path, small_silo):
    """A 784-1200-10 MLP: the private refresh round's per-sample gradients need about 1 GB; under
    ``--max-memory 256M`` it is refused in one line before any gradient, its subprocess's peak memory that of
    the interpreter and torch; with room it runs."""
    import sys
    from pathlib import Path

    from conftest import fit_artifact, run_measured

    silo = SiloData(small_silo.x[:64], small_silo.y[:64], "fmnist", 10)
    write_silo(tmp_path / "s.h5", silo)
    fit_artifact(tmp_path / "c.h5", silo, "diag", kwargs={"hidden": 1200}, mixtures=1)
    assert CliRunner().invoke(pfuse, ["fuse", str(tmp_path / "c.h5"), "--method", "fedavg",
                                      "--out", str(tmp_path / "g.h5")]).exit_code == 0
    pfuse_bin = str(Path(sys.executable).parent / "pfuse")
    r, peak_kib = run_measured([pfuse_bin, "refresh", "--artifact", tmp_path / "c.h5", "--data", tmp_path / "s.h5",
                                "--at", tmp_path / "g.h5", "--max-memory", "256M", "--out", tmp_path / "r.h5"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "refresh round" in r.stderr and "0.25 GiB" in r.stderr, r.stderr
    assert peak_kib < 256 * 1024 + 700 * 1024, peak_kib  # the budget plus the interpreter and torch
    assert not (tmp_path / "r.h5").exists()
