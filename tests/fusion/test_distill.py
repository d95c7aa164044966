"""Distillation (FedBE's server step, shared by fedbe and ``pfuse fuse --distill``): the SWA
schedule as in the paper, the KL to the teacher ensemble goes down, truly unlabeled files, and
FedBE's Dirichlet samples are convex combinations of the client models."""

from __future__ import annotations

import dataclasses

import h5py
import pytest
import torch
from click.testing import CliRunner
from conftest import fit_artifact

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.fusion import FusionInputs, FusionOptions
from posterior_fusion.fusion.distill import DistillConfig, collects, distill, soft_labels, swa_lr
from posterior_fusion.fusion.methods.fedbe import FedBESettings, fedbe
from posterior_fusion.models.functional import batched_logits


def test_swa_schedule_is_fedbe_s():
    """Cyclic step size 1e-3 → 4e-4 within each 25-step cycle; models collected at the end of every
    cycle after step 250 (``004``, section 5.1)."""
    cfg = DistillConfig()
    assert swa_lr(0, cfg) == pytest.approx(1e-3 - (1e-3 - 4e-4) / 25)
    assert swa_lr(24, cfg) == pytest.approx(4e-4) and swa_lr(49, cfg) == pytest.approx(4e-4)
    assert swa_lr(25, cfg) == pytest.approx(swa_lr(0, cfg))
    assert all(swa_lr(s, cfg) > swa_lr(s + 1, cfg) for s in range(24))  # decays within a cycle
    assert [s for s in range(400) if collects(s, cfg)] == [274, 299, 324, 349, 374, 399]
    assert (cfg.epochs, cfg.batch_size, cfg.sharpen) == (20, 128, 2.0)


@pytest.fixture(scope="module")
def clients(tmp_path_factory, small_silo):
    folder = tmp_path_factory.mktemp("distill")
    paths = []
    for c in range(3):
        paths.append(folder / f"c{c}.h5")
        fit_artifact(paths[-1], SiloData(small_silo.x[c * 80 : (c + 1) * 80], small_silo.y[c * 80 : (c + 1) * 80],
                                         "fmnist", 10), "kron", mixtures=1, epochs=2, seed=c)
    unlabeled = SiloData(small_silo.x[240:300], None, "fmnist", 10)
    write_silo(folder / "unlabeled.h5", unlabeled)
    return folder, paths, [posterior_fusion.load(p) for p in paths]


def _kl(spec, teachers, w, x):
    p = soft_labels(spec, teachers, x, sharpen=1.0)
    logq = torch.log_softmax(batched_logits(spec, w[None], x)[0], -1)
    return (p * (p.clamp_min(1e-30).log() - logq)).sum(-1).mean().item()


def test_distillation_reduces_the_kl_to_the_teachers(clients):
    _, _, loaded = clients
    spec = loaded[0].model_spec
    teachers = torch.stack([c.components[0].map for c in loaded])
    start = teachers.mean(0)
    x = torch.as_tensor(loaded[0].components[0].map.new_zeros(0))  # placeholder, replaced below
    from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR, load_fmnist
    from posterior_fusion.data.silo import SiloData as S

    xs, _ = load_fmnist("train", EMBEDDED_FMNIST_DIR)
    x = S(xs[1000:1200], None, "fmnist", 10).inputs()
    cfg = DistillConfig(epochs=30, batch_size=32, lr_max=0.05, lr_min=0.01, cycle=5, swa_start=60, sharpen=1.0)
    w, record = distill(spec, teachers, start, x, cfg, torch.Generator().manual_seed(0), show_progress=False)
    before, after = _kl(spec, teachers, start, x), _kl(spec, teachers, w, x)
    assert after < 0.5 * before, (before, after)
    assert record["swa_models"] == len([s for s in range(record["steps"]) if collects(s, cfg)]) > 0


def test_fuse_distill_cli_with_a_truly_unlabeled_file(clients, tmp_path):
    folder, paths, _ = clients
    with h5py.File(folder / "unlabeled.h5") as f:
        assert "y" not in f  # no labels at all
    out = tmp_path / "g.h5"
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--out", str(out),
                                   "--unlabeled", str(folder / "unlabeled.h5"), "--distill", "--distill-recipe", "swa",
                                   "--distill-epochs", "2"])
    assert r.exit_code == 0, r.output
    g = posterior_fusion.load(out)
    assert len(g.members) == 1 and g.metadata["distill"]["teachers"] == 3 and g.metadata["distill"]["steps"] == 2
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--out", str(tmp_path / "h.h5"),
                                   "--distill", "--distill-recipe", "swa"])
    assert r.exit_code == 2 and "--distill-recipe swa needs unlabeled server data" in r.output


def test_fedbe_dirichlet_samples_are_convex_combinations(clients):
    _, _, loaded = clients
    res = fedbe(FusionInputs(loaded, FusionOptions(progress=False)), FedBESettings(num_samples=4, dirichlet=0.5))
    W = torch.stack([c.components[0].map.double() for c in loaded])  # (C, d)
    for s in res.members[1 + len(loaded):]:
        gamma = torch.linalg.lstsq(W.T, s.double()[:, None]).solution[:, 0]
        torch.testing.assert_close(W.T @ gamma, s.double(), rtol=1e-4, atol=1e-5)
        assert (gamma > -1e-4).all() and gamma.sum().item() == pytest.approx(1.0, abs=1e-4)
    assert res.info["distribution"] == "dirichlet"


def test_distill_members_starts_from_the_candidate_that_fits_the_soft_labels(clients, monkeypatch):
    """``--distill`` starts from the best of {mean, each member}: most top-1 agreement with the
    teachers, ties broken by cross-entropy to the sharpened soft labels — computed here model by
    model with ``torch.nn`` (independent of batched_logits); identical members pick the mean
    (FedBE's start)."""
    from torch.nn.utils import vector_to_parameters

    from posterior_fusion.fusion import distill as mod

    _, _, loaded = clients
    spec = loaded[0].model_spec
    members = [c.components[0].map for c in loaded]
    x = torch.rand(50, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    seen = {}

    def fake(spec_, teachers, start, x_, cfg, generator, show, targets=None):
        seen["start"] = start.clone()
        return start.clone(), {}

    monkeypatch.setattr(mod, "distill", fake)
    targets = soft_labels(spec, torch.stack(members), x, 2.0)
    candidates = [torch.stack(members).mean(0), *members]
    keys = []
    for w in candidates:
        net = spec.build()
        vector_to_parameters(w.float(), net.parameters())
        with torch.no_grad():
            logp = torch.log_softmax(net(x), -1)
        keys.append((-(logp.argmax(-1) == targets.argmax(-1)).float().mean().item(),
                     -(targets * logp).sum(-1).mean().item()))
    _, record = mod.distill_members(spec, members, x, show_progress=False)
    best = min(range(len(keys)), key=lambda i: (round(keys[i][0], 6), keys[i][1]))
    torch.testing.assert_close(seen["start"], candidates[best].float())
    assert record["start"] == ("mean" if best == 0 else f"member {best - 1}")
    assert record["start_agreement"] == pytest.approx(-keys[best][0])
    _, record = mod.distill_members(spec, [members[1]] * 3, x, show_progress=False)
    assert record["start"] == "mean"
    torch.testing.assert_close(seen["start"], members[1].float())


def test_agreement_prefers_a_member_to_a_near_uniform_mean(clients):
    """Two members that disagree everywhere average to a network that predicts near-uniformly:
    cross-entropy to the soft labels can prefer it, top-1 agreement does not."""
    from posterior_fusion.fusion.distill import fit_to_soft_labels

    _, _, loaded = clients
    spec = loaded[0].model_spec
    w = loaded[0].components[0].map
    x = torch.rand(64, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    targets = soft_labels(spec, w[None], x, 2.0)
    uniform = torch.zeros_like(w)  # every logit 0: the uniform prediction, cross-entropy log 10
    agree, ce = fit_to_soft_labels(spec, torch.stack([uniform, w]), x, targets)
    assert agree[1] == 1.0 and agree[0] < 1.0
    assert ce[0] == pytest.approx(float(torch.log(torch.tensor(10.0))), rel=1e-5)


@pytest.mark.parametrize("bad, name", [({"epochs": -1}, "epochs"), ({"batch_size": 0}, "batch_size"),
                                       ({"lr_min": 1e-2}, "lr_min"), ({"momentum": 1.0}, "momentum"),
                                       ({"sharpen": 0.0}, "sharpen"), ({"cycle": 0}, "cycle")])
def test_fedbe_s_schedule_refuses_a_bad_value_in_one_line_naming_it(bad, name):
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.settings import describe

    with pytest.raises(ConfigError, match=name) as err:
        DistillConfig(**bad).validate()
    assert "\n" not in str(err.value)
    assert {d["name"] for d in describe(DistillConfig)} == {f.name for f in dataclasses.fields(DistillConfig)}


def test_a_bad_recipe_value_names_the_option_it_came_from(tmp_path):
    """The recipe's settings are read by one library builder for the CLI and Flower; on the command line a value
    it cannot read is one line naming the user's flag, before any artifact is opened."""
    r = CliRunner().invoke(pfuse, ["fuse", str(tmp_path / "absent.h5"), "--distill", "--distill-steps", "abc",
                                   "--out", str(tmp_path / "g.h5")])
    assert r.exit_code == 2 and r.stderr.strip() == "error: setting '--distill-steps' must be int, got 'abc'"
