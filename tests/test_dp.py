"""Differentially private artifacts (``fit-local --dp``): the recorded guarantee equals Opacus' own accountant
on the recorded mechanisms, the clipped curvature's sensitivity holds on every sample (a worst case included)
and its unclipped sum is the fast capture's GGN diagonal, the noise is fresh per run, the refusals are one
line, and a membership attack that finds an overfit silo finds nothing under strong privacy."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.private import (
    clipped_diag_full_sums,
    clipped_kron_sums,
    per_sample_ggn_diagonal,
    private_diagonal,
)
from posterior_fusion.local.fit_config import DPConfig

pytest.importorskip("opacus", reason="differential privacy needs the `dp` extra (opacus)")


def _run(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


def _silo(tmp_path, small_silo, name="s.h5", lo=0, hi=120):
    write_silo(tmp_path / name, SiloData(small_silo.x[lo:hi, ::2, ::2].copy(), small_silo.y[lo:hi], "fmnist", 10))
    return tmp_path / name


KW = '{"in_features": 196, "hidden": 32}'


def test_the_recorded_guarantee_is_opacus_accountant_on_the_recorded_mechanisms(tmp_path, small_silo):
    from opacus.accountants import RDPAccountant

    silo = _silo(tmp_path, small_silo)
    r = _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "2", "--epochs", "2",
             "--structure", "diag", "--dp", "--dp-epsilon", "4", "--out", tmp_path / "a.h5")
    assert r.exit_code == 0, r.output
    art = posterior_fusion.load(tmp_path / "a.h5")
    dp = art.metadata["dp"]
    acc = RDPAccountant()
    acc.history = [(dp["noise_multiplier"], dp["sample_rate"], dp["steps"]), (dp["release_noise"], 1.0, dp["releases"])]
    assert math.isclose(acc.get_epsilon(dp["delta"]), dp["epsilon"], rel_tol=1e-9) and dp["epsilon"] <= 4.0
    assert dp["delta"] == pytest.approx(1 / 120) and dp["releases"] == 3 and dp["steps"] == 2 * 2 * math.ceil(120 / 64)
    # what is released: noisy counts summing to n_data, no data hash, no training loss or accuracy
    assert sum(art.metadata["class_counts"]) == art.n_data and "data_sha256" not in art.metadata
    assert all("final_loss" not in c.training for c in art.components)
    shown = _run("inspect", tmp_path / "a.h5", "--validate")
    assert "differential privacy, as recorded (checked below): (ε, δ)" in shown.output
    assert "under Opacus' accountant" in shown.output
    # fresh noise: a second run of the same command releases other values
    assert _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "2", "--epochs", "2",
                "--structure", "diag", "--dp", "--dp-epsilon", "4", "--out", tmp_path / "b.h5").exit_code == 0
    other = posterior_fusion.load(tmp_path / "b.h5")
    assert not torch.equal(art.components[0].map, other.components[0].map)
    assert not torch.equal(art.components[0].curvature.diagonal(), other.components[0].curvature.diagonal())


def test_without_dp_a_fit_is_the_plain_training_and_capture_bit_for_bit(small_silo):
    """Without ``dp`` no mechanism touches the fit: each component's MAP and curvature equal, bit for bit, plain
    training (``train_map``) and the fast capture run by hand from the same start and seed."""
    from posterior_fusion.local.capture import capture as plain_capture
    from posterior_fusion.local.fit import fit_components
    from posterior_fusion.local.fit_config import FitConfig, TrainConfig
    from posterior_fusion.local.init import initial_weights
    from posterior_fusion.local.train import train_map
    from posterior_fusion.models import ModelSpec

    silo = SiloData(small_silo.x[:96], small_silo.y[:96], "fmnist", 10)
    spec = ModelSpec("mlp", {"hidden": 16})
    cfg = FitConfig(structure="diag", train_seed=5, train=TrainConfig(epochs=2, batch_size=32))
    starts = initial_weights(spec, 2, 0)
    _, comps = fit_components(spec, silo, starts, cfg, log=lambda *_: None)
    x, y = silo.tensors()
    resolved = cfg.resolved(len(silo))
    for m, comp in enumerate(comps):
        model = spec.build()
        torch.nn.utils.vector_to_parameters(starts[m].clone(), model.parameters())
        seed = 5 * 1_000_003 + m
        torch.manual_seed(seed)
        train_map(model, x, y, resolved.train, seed=seed, desc="reference")
        curv, _ = plain_capture("diag", model, x, y, cfg.curvature_batch_size, cfg.ggn, cfg.capture,
                                torch.Generator().manual_seed(seed), lambda *_: None)
        assert torch.equal(comp.map, torch.nn.utils.parameters_to_vector(model.parameters()).detach())
        assert torch.equal(comp.curvature.diagonal(), curv.diagonal())


def test_the_clipped_curvature_has_its_sensitivity_and_sums_to_the_ggn_diagonal():
    """Removing any one sample (a worst-case one with a huge input included) moves the clipped sum by at most
    ``curvature_clip`` in L2; without clipping the per-sample contributions sum to the fast capture's exact GGN
    diagonal (an independent computation)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4)).eval()
    x = torch.randn(20, 6)
    x[3] *= 1e3  # a sample whose contribution dwarfs the others
    y = torch.randint(0, 4, (20,))
    cfg = DPConfig(dp_curvature_clip=0.5)
    whole = private_diagonal(model, x, cfg, 0.0, torch.Generator()).double()
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        without = private_diagonal(model, x[keep], cfg, 0.0, torch.Generator()).double()
        assert (whole - without).norm() <= 0.5 * (1 + 1e-5)
    raw = per_sample_ggn_diagonal(model, x[:8]).double().sum(0)
    fast, _ = capture("diag", model, x[:8], y[:8], 8)
    torch.testing.assert_close(raw, fast.diagonal().double(), rtol=1e-4, atol=1e-6)


def _accountant_epsilon(dp: dict) -> float:
    """Opacus' own accountant on the recorded mechanisms: every gradient pass at the recorded noise multiplier,
    the releases at theirs."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(dp["noise_multiplier"], dp["sample_rate"], dp["steps"]),
                   *[(dp["noise_multiplier"], p["sample_rate"], p["steps"]) for p in dp.get("passes", [])],
                   (dp["release_noise"], 1.0, dp["releases"])]
    return acc.get_epsilon(dp["delta"])


PPD = ("--ppd", "--ppd-steps", "40", "--ppd-burn-in", "10", "--ppd-thin", "5", "--ppd-batch-size", "32",
       "--ppd-step-size", "1e-4")


def test_a_private_fedppd_student_is_in_the_accounted_release(tmp_path, small_silo):
    """``--dp --ppd``: the SGLD chain and the student's distillation are two more recorded passes at the
    training's noise multiplier (their steps from the chain's settings), Opacus' accountant on all of it gives
    the recorded ε within the target; the student moved from the MAP; fedppd fuses two such artifacts."""
    paths = []
    for i, (lo, hi) in enumerate(((0, 120), (120, 240))):
        silo = _silo(tmp_path, small_silo, f"s{i}.h5", lo, hi)
        out = tmp_path / f"ppd{i}.h5"
        r = _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "2", "--epochs", "2",
                 "--structure", "diag", "--dp", "--dp-epsilon", "6", *PPD, "--out", out)
        assert r.exit_code == 0, r.output
        paths.append(out)
    art = posterior_fusion.load(paths[0])
    dp = art.metadata["dp"]
    kept = len(range(10, 40, 5))
    assert dp["passes"] == [{"part": "ppd chain", "sample_rate": pytest.approx(32 / 120), "steps": 2 * 40},
                            {"part": "ppd student", "sample_rate": pytest.approx(32 / 120), "steps": 2 * kept}]
    assert math.isclose(_accountant_epsilon(dp), dp["epsilon"], rel_tol=1e-9) and dp["epsilon"] <= 6.0
    # the same fit without the chain spends the budget on fewer steps: less noise
    r = _run("fit-local", "--data", tmp_path / "s0.h5", "--model", "mlp", "--model-kwargs", KW, "-M", "2",
             "--epochs", "2", "--structure", "diag", "--dp", "--dp-epsilon", "6", "--out", tmp_path / "plain.h5")
    assert r.exit_code == 0, r.output
    assert posterior_fusion.load(tmp_path / "plain.h5").metadata["dp"]["noise_multiplier"] < dp["noise_multiplier"]
    for c in art.components:
        assert c.student is not None and c.training["ppd_samples"] == kept
        assert c.training["ppd_chain_excess_noise"] >= 0 and not torch.equal(c.student, c.map)
    assert "ppd chain" in _run("inspect", paths[0], "--validate").output
    r = _run("fuse", *paths, "--method", "fedppd", "--out", tmp_path / "g.h5")
    assert r.exit_code == 0, r.output


def test_a_local_model_is_trained_privately_and_accounted(tmp_path, small_silo):
    """``--dp --local-model``: HBFL's local model is one more DP-SGD pass (epochs × ⌈n / batch⌉ steps at the
    training's rate), the recorded ε Opacus' accountant's; the artifact holds only the shared model."""
    silo = _silo(tmp_path, small_silo)
    r = _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "2",
             "--structure", "diag", "--dp", "--dp-epsilon", "5", "--local-model", "mlp", "--local-model-kwargs",
             '{"in_features": 196, "hidden": 16}', "--local-model-epochs", "3", "--out", tmp_path / "h.h5")
    assert r.exit_code == 0, r.output
    dp = posterior_fusion.load(tmp_path / "h.h5").metadata["dp"]
    assert dp["passes"] == [{"part": "local model", "sample_rate": pytest.approx(64 / 120),
                             "steps": 3 * math.ceil(120 / 64)}]
    assert math.isclose(_accountant_epsilon(dp), dp["epsilon"], rel_tol=1e-9) and dp["epsilon"] <= 5.0


def test_the_training_noise_comes_from_its_own_generator_not_the_recorded_seed():
    """Opacus' gradient noise is drawn from the generator the fit seeds from the system's entropy: the same
    generator state gives the same local model whatever the global seed (the recorded training seed sets it),
    another state another model."""
    from posterior_fusion.local.fit_config import TrainConfig
    from posterior_fusion.local.privacy.accounting import plan
    from posterior_fusion.local.privacy.training import private_train

    x, y = torch.randn(50, 6), torch.randint(0, 3, (50,))
    cfg = DPConfig(dp_epsilon=2.0)
    p = plan(cfg, 50, 16, 2, 1)

    def trained(global_seed: int, noise_seed: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 3))  # one start for every run
        torch.manual_seed(global_seed)
        private_train(model, x, y, TrainConfig(epochs=2, batch_size=16, lr=0.1), cfg, p, 0.0, 7,
                      torch.Generator().manual_seed(noise_seed))
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    assert torch.equal(trained(1, 11), trained(2, 11))   # the global seed does not draw the noise
    assert not torch.equal(trained(1, 11), trained(1, 12))


def test_private_refusals_are_one_line(tmp_path, small_silo):
    silo = _silo(tmp_path, small_silo)
    assert _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "1",
                "--structure", "diag", "--dp", "--out", tmp_path / "p.h5").exit_code == 0
    assert _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "1",
                "--structure", "diag", "--out", tmp_path / "n.h5").exit_code == 0
    r = _run("fuse", tmp_path / "p.h5", tmp_path / "n.h5", "--method", "fedavg", "--out", tmp_path / "g.h5")
    assert r.exit_code == 2 and "differentially private" in r.stderr and r.stderr.count("\n") == 1, r.output
    r = _run("fuse", tmp_path / "p.h5", tmp_path / "n.h5", "--method", "fedavg", "--allow-mixed-privacy",
             "--out", tmp_path / "g.h5")
    assert r.exit_code == 0 and "no guarantee for the non-private" in r.stderr, r.output
    meta = posterior_fusion.load(tmp_path / "g.h5").metadata
    assert meta["mixed_privacy"] == {"private": [str(tmp_path / "p.h5")], "not_private": [str(tmp_path / "n.h5")]}
    assert "dp" in meta["provenance"][0] and "dp" not in meta["provenance"][1]
    r = _run("recapture", "--artifact", tmp_path / "p.h5", "--data", silo, "--out", tmp_path / "r.h5")
    assert r.exit_code == 2 and "accounted budget" in r.stderr, r.output


def test_strong_privacy_leaves_the_membership_attack_nothing(tmp_path, small_silo):
    """The same overfitting recipe that the loss-threshold attack finds without privacy (test_audit: AUC > 0.7)
    trained under ε = 1: the attack's AUC is near chance."""
    silo = _silo(tmp_path, small_silo)
    held = _silo(tmp_path, small_silo, "h.h5", 240, 300)
    r = _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", '{"in_features": 196, "hidden": 256}',
             "-M", "1", "--epochs", "150", "--lr", "0.1", "--weight-decay", "0", "--structure", "diag", "--dp",
             "--dp-epsilon", "1", "--out", tmp_path / "dp.h5")
    assert r.exit_code == 0, r.output
    report = json.loads(_run("audit", tmp_path / "dp.h5", "--data", silo, "--holdout", held, "--json").stdout)
    assert abs(report["membership"]["auc"] - 0.5) < 0.12, report["membership"]


def _convnet() -> nn.Module:
    """Conv2d, GroupNorm (a diagonal block), Linear with a bias: every kind of block the K-FAC release holds."""
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(3 * 5 * 5, 4)).double().eval()


@pytest.mark.parametrize("kfac", ["expand", "reduce"])
def test_the_kron_sums_without_clipping_are_the_fast_capture(kfac):
    """With clips no sample reaches, the per-sample K-FAC contributions sum to the fast capture's factors (the input
    factors times n) and its normalisation-layer diagonal — an independent computation of the same quantities."""
    torch.manual_seed(0)
    model = _convnet()
    x, y = torch.randn(12, 1, 5, 5, dtype=torch.float64), torch.randint(0, 4, (12,))
    A, B, D = clipped_kron_sums(model, x, 1e12, 1e12, kfac, batch_size=5)
    fast, _ = capture("kron", model, x, y, 5, kfac=kfac)
    blocks = fast.blocks  # conv: Kron, Dense(bias); GroupNorm: 2 x Diag; linear: Kron, Dense(bias)
    for k, (kron, diag) in ((0, (0, None)), (1, (None, (2, 3))), (2, (4, None))):
        if kron is not None:
            t = blocks[kron].to_tensors()
            torch.testing.assert_close(A[k] / len(x), t["kron_A"].double(), rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(B[k], t["kron_B"].double(), rtol=1e-9, atol=1e-12)
        else:
            for d, j in zip(D[k], diag):
                torch.testing.assert_close(d.reshape(-1), blocks[j].diagonal().double(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kfac", ["expand", "reduce"])
def test_the_clipped_kron_sums_move_by_at_most_their_clips(kfac):
    """Removing any one sample (a worst-case one with a huge input among them) moves the input factors' sums by at
    most ``dp_input_clip`` and the output factors' and diagonals' sums by at most ``dp_curvature_clip``
    (Frobenius / L2 over every layer together) — the sensitivity the noise is calibrated to."""
    torch.manual_seed(1)
    model = _convnet()
    x = torch.randn(10, 1, 5, 5, dtype=torch.float64)
    x[4] *= 1e3
    ca, cb = 0.7, 0.05

    def parts(xs):
        A, B, D = clipped_kron_sums(model, xs, ca, cb, kfac, batch_size=4)
        return ([a for a in A if torch.is_tensor(a)], [b for b in B if torch.is_tensor(b)] + [t for d in D if d for t in d])

    whole = parts(x)
    for i in range(len(x)):
        keep = torch.arange(len(x)) != i
        less = parts(x[keep])
        moved_a = sum(((u - v) ** 2).sum() for u, v in zip(whole[0], less[0])).sqrt()
        moved_b = sum(((u - v) ** 2).sum() for u, v in zip(whole[1], less[1])).sqrt()
        assert moved_a <= ca * (1 + 1e-9) and moved_b <= cb * (1 + 1e-9), (i, moved_a, moved_b)


def test_a_private_kron_artifact_fuses_and_records_its_clips(tmp_path, small_silo):
    """``fit-local --dp --structure kron``: Kronecker blocks, both clips in the record, the guarantee Opacus'
    accountant's; fedbens and Fisher merge fuse two such artifacts."""
    from opacus.accountants import RDPAccountant

    paths = []
    for c in range(2):
        silo = tmp_path / f"s{c}.h5"  # LeNet's 28 x 28 images
        write_silo(silo, SiloData(small_silo.x[120 * c: 120 * (c + 1)], small_silo.y[120 * c: 120 * (c + 1)], "fmnist", 10))
        r = _run("fit-local", "--data", silo, "--model", "lenet", "-M", "1", "--epochs", "1", "--structure", "kron",
                 "--dp", "--dp-epsilon", "8", "--train-seed", c, "--out", tmp_path / f"k{c}.h5")
        assert r.exit_code == 0, r.output
        paths.append(tmp_path / f"k{c}.h5")
    art = posterior_fusion.load(paths[0])
    dp = art.metadata["dp"]
    assert dp["input_clip"] == DPConfig().dp_input_clip and "K-FAC" in dp["mechanism"]
    assert "kron" in {b.kind for b in art.components[0].curvature.blocks}
    acc = RDPAccountant()
    acc.history = [(dp["noise_multiplier"], dp["sample_rate"], dp["steps"]), (dp["release_noise"], 1.0, dp["releases"])]
    assert math.isclose(acc.get_epsilon(dp["delta"]), dp["epsilon"], rel_tol=1e-9) and dp["epsilon"] <= 8.0
    for method, extra in (("fedbens", ("--set", "steps=5")), ("fisher-merge", ())):
        r = _run("fuse", *paths, "--method", method, *extra, "--out", tmp_path / f"g_{method}.h5")
        assert r.exit_code == 0, (method, r.output)


def _mlp(bias: bool = True) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4, bias=bias)).double().eval()


@pytest.mark.parametrize("bias", [True, False])
def test_the_diag_full_sums_without_clipping_are_the_fast_capture(bias):
    """With a clip no sample reaches, the per-sample diagonal and last-layer blocks sum to the fast capture's
    diag+full blocks (its diagonal from back-propagated columns, its block in closed form): the same quantities
    computed independently."""
    torch.manual_seed(2)
    model = _mlp(bias)
    x, y = torch.randn(14, 6, dtype=torch.float64), torch.randint(0, 4, (14,))
    diag, block = clipped_diag_full_sums(model, x, 1e12, batch_size=5)
    fast, _ = capture("diag+full", model, x, y, 5)
    torch.testing.assert_close(diag, fast.blocks[0].diagonal().double(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(block, fast.blocks[1].to_tensors()["dense"].double(), rtol=1e-9, atol=1e-12)


def test_the_clipped_diag_full_sums_move_by_at_most_the_clip():
    """Removing any one sample (a worst-case one with a huge input among them) moves the diagonal and the block's
    upper triangle together by at most ``dp_curvature_clip`` in L2 — the sensitivity the noise is calibrated to —
    and a clip that binds does move them by about that much."""
    torch.manual_seed(3)
    model = _mlp()
    x = torch.randn(12, 6, dtype=torch.float64)
    x[5] *= 1e3
    clip = 0.05
    rows, cols = torch.triu_indices(4 * 6, 4 * 6)

    def released(xs):
        diag, block = clipped_diag_full_sums(model, xs, clip, batch_size=5)
        return torch.cat([diag, block[rows, cols]])

    whole = released(x)
    moved = [(whole - released(x[torch.arange(len(x)) != i])).norm() for i in range(len(x))]
    assert max(moved) <= clip * (1 + 1e-9), moved
    assert max(moved) >= 0.5 * clip  # the worst-case sample is clipped, not ignored


@pytest.mark.parametrize("clip", [1.0, 0.05])
def test_a_saturated_sample_cannot_move_the_float32_diag_full_release_past_the_clip(clip):
    """The model in float32, as fits run it: 63 copies of one sample and one sample ×1e9, whose softmax saturates
    (its true contribution is tiny and rightly unclipped). Removing any one sample moves the released diagonal
    and block by at most the clip: the per-sample blocks are formed without a difference of two sums, so one
    sample cannot cancel the others' contributions in rounding."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4)).eval()  # the last layer's input unbounded
    x = torch.randn(1, 6).repeat(64, 1)
    x[-1] = torch.randn(6) * 1e9
    rows, cols = torch.triu_indices(4 * 6, 4 * 6)

    def released(xs):
        diag, block = clipped_diag_full_sums(model, xs, clip, batch_size=16)
        return torch.cat([diag, block[rows, cols]])

    whole = released(x)
    for i in (0, 31, 63):
        less = released(x[torch.arange(len(x)) != i])
        assert float((whole - less).norm()) <= clip * (1 + 1e-6), (i, float((whole - less).norm()))


def test_a_private_diag_full_artifact_fuses_and_records_its_release(tmp_path, small_silo):
    """``fit-local --dp --structure diag+full``: a diagonal and a dense last-layer block, positive semi-definite,
    the guarantee Opacus' accountant's; the product and Fisher merge fuse two such artifacts."""
    from opacus.accountants import RDPAccountant

    paths = []
    for c in range(2):
        silo = _silo(tmp_path, small_silo, f"s{c}.h5", 120 * c, 120 * (c + 1))
        r = _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "1",
                 "--structure", "diag+full", "--dp", "--dp-epsilon", "8", "--train-seed", c,
                 "--out", tmp_path / f"f{c}.h5")
        assert r.exit_code == 0, r.output
        paths.append(tmp_path / f"f{c}.h5")
    art = posterior_fusion.load(paths[0])
    dp = art.metadata["dp"]
    assert "last-layer block" in dp["mechanism"]
    kinds = [b.kind for b in art.components[0].curvature.blocks]
    assert kinds == ["diag", "dense"]
    dense = art.components[0].curvature.blocks[1].to_tensors()["dense"].double()
    assert dense.shape == (10 * 33, 10 * 33) and torch.linalg.eigvalsh(dense).min() >= -1e-4 * dense.abs().max()
    acc = RDPAccountant()
    acc.history = [(dp["noise_multiplier"], dp["sample_rate"], dp["steps"]), (dp["release_noise"], 1.0, dp["releases"])]
    assert math.isclose(acc.get_epsilon(dp["delta"]), dp["epsilon"], rel_tol=1e-9) and dp["epsilon"] <= 8.0
    for method in ("product", "fisher-merge"):
        r = _run("fuse", *paths, "--method", method, "--out", tmp_path / f"g_{method}.h5")
        assert r.exit_code == 0, (method, r.output)


def test_swag_moments_of_the_private_iterates_cost_no_further_epsilon(tmp_path, small_silo):
    """``--dp --swag``: the moments are DP-SGD's own iterates' (post-processing), so the recorded release and ε are
    those of the same fit without SWAG — Opacus' accountant on the recorded mechanisms — and the swag fusion runs."""
    from opacus.accountants import RDPAccountant

    silo = _silo(tmp_path, small_silo)
    records = {}
    for swag in (False, True):
        out = tmp_path / f"swag{swag}.h5"
        r = _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "8",
                 "--structure", "diag", "--dp", "--dp-epsilon", "4", *(("--swag", "--swag-rank", "3") if swag else ()),
                 "--out", out)
        assert r.exit_code == 0, r.output
        records[swag] = posterior_fusion.load(out)
    moments = records[True].components[0].swag
    assert moments is not None and moments.deviations.shape[0] == 3
    assert records[False].components[0].swag is None
    dp = records[True].metadata["dp"]
    keys = ("noise_multiplier", "sample_rate", "steps", "release_noise", "releases", "epsilon")
    assert {k: dp[k] for k in keys} == {k: records[False].metadata["dp"][k] for k in keys}
    acc = RDPAccountant()
    acc.history = [(dp["noise_multiplier"], dp["sample_rate"], dp["steps"]), (dp["release_noise"], 1.0, dp["releases"])]
    assert math.isclose(acc.get_epsilon(dp["delta"]), dp["epsilon"], rel_tol=1e-9)
    # the moments' mean lies among the private iterates: near the private MAP, not at the start
    assert (moments.mean - records[True].components[0].map).norm() < records[True].components[0].map.norm()
    other = _silo(tmp_path, small_silo, "o.h5", 120, 240)
    assert _run("fit-local", "--data", other, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "8",
                "--structure", "diag", "--dp", "--dp-epsilon", "4", "--swag", "--swag-rank", "3",
                "--out", tmp_path / "o_swag.h5").exit_code == 0
    r = _run("fuse", tmp_path / "swagTrue.h5", tmp_path / "o_swag.h5", "--method", "swag", "--out", tmp_path / "g.h5")
    assert r.exit_code == 0, r.output


def test_a_privacy_setting_without_dp_is_refused_never_a_plain_fit(tmp_path, small_silo):
    """``--dp-epsilon`` (or any other dp setting) without ``--dp``: one line, exit 2, nothing written — on the CLI
    (even at the default value), in a TOML-style flat table and in the Flower settings."""
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.flower.federated_settings import FederatedSettings
    from posterior_fusion.local.fit_config import fit_config_from

    silo = _silo(tmp_path, small_silo)
    for extra in (["--dp-epsilon", "3"], ["--dp-epsilon", "8"], ["--dp-delta", "1e-5"], ["--dp-clip", "2"]):
        out = tmp_path / "plain.h5"
        r = _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", '{"hidden": 4}', "-M", "1",
                 "--epochs", "1", "--structure", "diag", *extra, "--out", out)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "--dp" in r.stderr and not out.exists(), r.output
    with pytest.raises(ConfigError, match="differential privacy is off"):
        fit_config_from({"dp_epsilon": 3.0})
    with pytest.raises(ConfigError, match="differential privacy is off"):
        FederatedSettings(dp_epsilon=3.0).fit_config()
    assert fit_config_from({"dp": True, "dp_epsilon": 3.0}).dp.dp_epsilon == 3.0


# Every field a private artifact holds, and why it may: the accounted release, or public by design
# (docs/security.md, "What a private artifact holds"). A field that appears without a line here fails the test.
PRIVATE_METADATA = {
    "n_data": "the sum of the noisy class counts (the release)", "class_counts": "the noisy histogram (the release)",
    "dp": "the mechanisms and their (ε, δ); n enters as public (δ = 1/n, the sampling rate)",
    "num_classes": "the model's", "input_shape": "one input's shape, the model's", "dataset": "the data set's name, chosen by the federation",
    "input_transform": "data-independent, or computed from public data (dp_public_transform); no file name",
    "temperature": "a setting", "prior_precision": "a setting", "structure": "a setting", "train_seed": "a setting",
    "curvature_batch_size": "a setting", "ggn": "a setting", "kfac": "a setting", "train": "the settings DP-SGD used",
    "library_versions": "the software's", "fit_fingerprint": "a hash of the recipe and the released values",
    "curvature_blocks": "the model's layer policy", "init": "the starting points' origin (server-chosen)",
    "format": "the file's", "format_version": "the file's", "num_components": "M, a setting",
    "model_spec": "the model's", "layout": "the model's", "laplace": "the prior, a setting",
    "created_with": "the software's", "kind": "the file's",
}
PRIVATE_TRAINING = {"seed": "a setting", "epochs": "a setting", "capture": "the method's", "device": "cpu or cuda"}


def test_a_private_artifact_holds_only_classified_fields_and_no_data_fingerprint(tmp_path, small_silo):
    """Every metadata and training field of a private artifact is in the tables above; the fingerprint does not
    depend on the data (two silos differing in one sample give the same recipe hash), no timing is recorded,
    the recorded weight decay is the one DP-SGD used (from the released n), a transform computed from data is
    refused unless declared public, and the transform's file name is not kept."""
    from posterior_fusion.data.transform import InputTransform

    silo = _silo(tmp_path, small_silo)
    other = _silo(tmp_path, small_silo, "t.h5", 1, 121)  # one sample out, another in
    arts = []
    for name, data in (("a.h5", silo), ("b.h5", other)):
        r = _run("fit-local", "--data", data, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "1",
                 "--structure", "diag", "--dp", "--dp-epsilon", "4", "--out", tmp_path / name)
        assert r.exit_code == 0, r.output
        arts.append(posterior_fusion.load(tmp_path / name))
    art = arts[0]
    unclassified = set(art.metadata) - set(PRIVATE_METADATA)
    assert not unclassified, f"classify these private-artifact fields in PRIVATE_METADATA: {sorted(unclassified)}"
    for comp in art.components:
        assert not set(comp.training) - set(PRIVATE_TRAINING), sorted(set(comp.training) - set(PRIVATE_TRAINING))
    recipe = {k: v for k, v in art.metadata.items() if k not in ("n_data", "class_counts", "dp", "fit_fingerprint",
                                                                 "train")}
    assert recipe == {k: v for k, v in arts[1].metadata.items() if k in recipe}  # nothing tells the silos apart
    T, lam = art.metadata["temperature"], art.metadata["prior_precision"]
    assert art.metadata["train"]["weight_decay"] == pytest.approx(T * lam / art.n_data, rel=1e-12)
    # a transform computed from the silo's own data is refused; declared public, it is taken without its file name
    x = small_silo.x[:120, ::2, ::2].copy()
    t = InputTransform.compute(x, "own.npz")
    write_silo(tmp_path / "own.h5", SiloData(x, small_silo.y[:120], "fmnist", 10, transform=t))
    r = _run("fit-local", "--data", tmp_path / "own.h5", "--model", "mlp", "--model-kwargs", KW, "-M", "1",
             "--epochs", "1", "--structure", "diag", "--dp", "--out", tmp_path / "own_art.h5")
    assert r.exit_code == 2 and "dp_public_transform" in r.stderr.replace("-", "_") and r.stderr.count("\n") == 1
    r = _run("fit-local", "--data", tmp_path / "own.h5", "--model", "mlp", "--model-kwargs", KW, "-M", "1",
             "--epochs", "1", "--structure", "diag", "--dp", "--dp-public-transform", "--out", tmp_path / "own_art.h5")
    assert r.exit_code == 0, r.output
    assert posterior_fusion.load(tmp_path / "own_art.h5").metadata["input_transform"]["source"] == \
        "computed from public data"


def test_privacy_records_are_read_as_a_schema_and_checked_against_what_they_claim(tmp_path, small_silo):
    """A ``dp`` record forged onto a plain artifact, one whose ε the recorded mechanisms do not give, a negative ε,
    an empty or malformed record, a malformed refresh record: each refused in one line by ``fuse`` and ``inspect``
    (never a traceback, never a guarantee printed as the artifact's own)."""
    import json
    import shutil

    import h5py

    from posterior_fusion.artifact.writer import text_attr

    silo = _silo(tmp_path, small_silo)
    plain, private = tmp_path / "plain.h5", tmp_path / "private.h5"
    for out, extra in ((plain, []), (private, ["--dp", "--dp-epsilon", "4"])):
        r = _run("fit-local", "--data", silo, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "1",
                 "--structure", "diag", *extra, "--out", out)
        assert r.exit_code == 0, r.output
    real = posterior_fusion.load(private).metadata["dp"]
    other = _silo(tmp_path, small_silo, "o.h5", 120, 240)
    assert _run("fit-local", "--data", other, "--model", "mlp", "--model-kwargs", KW, "-M", "1", "--epochs", "1",
                "--structure", "diag", "--out", tmp_path / "honest.h5").exit_code == 0

    def forged(name, edit):
        path = tmp_path / f"{name}.h5"
        shutil.copy(plain if name.startswith("plain") else private, path)
        with h5py.File(path, "r+") as f:
            meta = json.loads(f.attrs["metadata"])
            edit(meta)
            f.attrs["metadata"] = text_attr(json.dumps(meta))
        return path

    cases = {
        "plain_given_dp": (lambda m: m.update(dp=dict(real)), "never releases"),
        "wrong_epsilon": (lambda m: m["dp"].update(epsilon=0.5), "accountant"),
        "negative_epsilon": (lambda m: m["dp"].update(epsilon=-1), "dp.epsilon"),
        "string_epsilon": (lambda m: m["dp"].update(epsilon="tiny"), "dp.epsilon"),
        "empty_dp": (lambda m: m.update(dp={}), "dp.epsilon"),
        "passes_five": (lambda m: m["dp"].update(passes=5), "dp.passes"),
        "refreshed_list": (lambda m: m.update(refreshed_at=[1]), "refreshed_at"),
        "refresh_dp_string": (lambda m: m.update(refreshed_at={"file_sha256": "0" * 64, "method": "fedavg",
                                                               "members": 1, "damping": 1.0, "dp": "tiny"}),
                              "refreshed_at.dp"),
    }
    for name, (edit, words) in cases.items():
        path = forged(name, edit)
        for args in (("fuse", path, tmp_path / "honest.h5", "--method", "fedavg", "--allow-mixed-privacy",
                      "--out", tmp_path / "g.h5"), ("inspect", path, "--validate")):
            r = _run(*args)
            errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
            assert r.exit_code == 2 and len(errors) == 1 and words in errors[0] and path.name in errors[0], (name, r.output)
            assert "Traceback" not in r.output and not (tmp_path / "g.h5").exists()
