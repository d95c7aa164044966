"""BatchNorm trained from random starting points: the silo's statistics folded into the affine parameters
(against PyTorch's own evaluation-mode BatchNorm with ``torch.optim.swa_utils.update_bn``'s statistics), the
server's RESET rule (against ``update_bn`` on the network read back under the clients' statistics), the pooled
statistics (against the moments of the pooled data), and the whole flow through the CLI."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import posterior_fusion
from posterior_fusion.artifact.reader import variance_mask
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.models.batchnorm import (
    batch_norms,
    fold_statistics,
    pooled_statistics,
    reset_statistics,
    thaw,
)
from posterior_fusion.models.finetune import FrozenBatchNorm1d, FrozenBatchNorm2d, freeze_statistics


def bn_cnn() -> nn.Module:
    """Both BatchNorm kinds, in the frozen form a spec builds (statistics (0, 1)); a large ε, so that every
    place it enters the folding shows."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, eps=0.1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 36, 8), nn.BatchNorm1d(8, eps=0.1), nn.ReLU(), nn.Linear(8, 3))
    freeze_statistics(model, None)
    return model


def trained(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``model`` thawed and trained a few SGD steps with batch statistics (affine parameters away from (1, 0))."""
    thaw(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    y = torch.arange(x.shape[0]) % 3
    for _ in range(8):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def chunks(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [x[i: i + size] for i in range(0, x.shape[0], size)]


def test_folding_keeps_the_trained_network_s_function():
    """The folded network (statistics (0, 1), frozen) computes what PyTorch's evaluation-mode BatchNorm computes
    with the statistics ``update_bn`` estimates on the same batches, and the statistics returned are those."""
    torch.manual_seed(0)
    x = torch.randn(70, 1, 6, 6) * 2 + 0.5
    model = trained(bn_cnn(), x)
    reference = copy.deepcopy(model)
    torch.optim.swa_utils.update_bn(chunks(x, 32), reference)
    reference.eval()
    stats = fold_statistics(model, x, 32)
    expected = torch.cat([t for _, m in batch_norms(reference) for t in (m.running_mean, m.running_var)])
    torch.testing.assert_close(stats, expected, rtol=1e-6, atol=1e-6)
    assert stats.shape == (2 * (4 + 8),)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
    model.train()  # frozen for good: evaluation mode whatever is asked
    for _, m in batch_norms(model):
        assert isinstance(m, (FrozenBatchNorm1d, FrozenBatchNorm2d)) and not m.training
        assert torch.equal(m.running_mean, torch.zeros_like(m.running_mean))
        assert torch.equal(m.running_var, torch.ones_like(m.running_var))
    torch.testing.assert_close(model(x[:5]), reference(x[:5]), rtol=1e-5, atol=1e-5)


def test_reset_is_update_bn_under_the_target_statistics():
    """RESET of a folded network: its BatchNorms read back as (γ, β) under the target statistics, then PyTorch's
    ``update_bn`` on the server's inputs — the reference builds that network by hand from the folded parameters."""
    torch.manual_seed(1)
    x = torch.randn(60, 1, 6, 6)
    folded = trained(bn_cnn(), x)
    silo_stats = fold_statistics(folded, x, 32)
    target = silo_stats * torch.linspace(0.7, 1.3, silo_stats.numel())  # some other clients' statistics
    server = torch.randn(50, 1, 6, 6) * 1.5 - 0.3
    reference = copy.deepcopy(folded)
    sizes = [m.num_features for _, m in batch_norms(reference)]
    parts = torch.split(target, [n for s in sizes for n in (s, s)])
    with torch.no_grad():
        for i, (_, m) in enumerate(batch_norms(reference)):
            mean, var = parts[2 * i], parts[2 * i + 1]
            gamma = m.weight * torch.sqrt(var + m.eps) / np.sqrt(1 + m.eps)  # γ' = γ √(1+ε)/√(σ²+ε), inverted
            m.bias.add_(gamma * mean / torch.sqrt(var + m.eps))
            m.weight.copy_(gamma)
    thaw(reference)
    torch.optim.swa_utils.update_bn(chunks(server, 16), reference)
    reference.eval()
    estimated = reset_statistics(folded, target, server, 16)
    torch.testing.assert_close(folded(server), reference(server), rtol=1e-5, atol=1e-5)
    expected = torch.cat([t for _, m in batch_norms(reference) for t in (m.running_mean, m.running_var)])
    torch.testing.assert_close(estimated, expected, rtol=1e-6, atol=1e-6)


def test_pooled_statistics_are_the_moments_of_the_pooled_data():
    """The clients' pooled statistics, weighted by their sizes, are the mean and variance of their data together."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(30, 5, generator=gen, dtype=torch.float64) * 2 + 1
    b = torch.randn(50, 5, generator=gen, dtype=torch.float64) * 0.5 - 3
    c = torch.randn(20, 3, generator=gen, dtype=torch.float64)  # a second layer, only for the layout
    d = torch.randn(40, 3, generator=gen, dtype=torch.float64) + 4

    def stats(u, v):
        return torch.cat([u.mean(0), u.var(0, unbiased=False), v.mean(0), v.var(0, unbiased=False)])

    pooled = pooled_statistics([stats(a, c), stats(b, d)], [30, 50], [5, 3])
    both_first = torch.cat([a, b])
    expected = torch.cat([both_first.mean(0), both_first.var(0, unbiased=False)])
    torch.testing.assert_close(pooled[:10].double(), expected, rtol=1e-6, atol=1e-6)
    # the second layer's populations weigh the same (the clients' sizes), whatever its rows were
    mixed = pooled_statistics([stats(c, c), stats(d, d)], [30, 50], [3, 3])[6:]
    mean = 0.375 * c.mean(0) + 0.625 * d.mean(0)
    var = 0.375 * (c.var(0, unbiased=False) + c.mean(0) ** 2) + 0.625 * (d.var(0, unbiased=False) + d.mean(0) ** 2) - mean ** 2
    torch.testing.assert_close(mixed.double(), torch.cat([mean, var]), rtol=1e-6, atol=1e-6)


KW = '{"in_channels": 1, "width": 4, "norm": "batch"}'


def run(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


@pytest.fixture(scope="module")
def bn_silos(tmp_path_factory, fmnist_train):
    """Two BatchNorm ResNet silos fitted from shared random starting points (kron, M = 2) and the server's inputs."""
    folder = tmp_path_factory.mktemp("bn")
    x, y = fmnist_train
    for c in range(2):
        write_silo(folder / f"s{c}.h5", SiloData(x[c * 80:(c + 1) * 80], y[c * 80:(c + 1) * 80], "fmnist", 10))
    write_silo(folder / "server.h5", SiloData(x[200:300], y[200:300], "fmnist", 10))
    for c in range(2):
        r = run("fit-local", "--data", folder / f"s{c}.h5", "--model", "resnet20", "--model-kwargs", KW, "-M", "2",
                "--epochs", "2", "--train-seed", c, "--out", folder / f"k{c}.h5")
        assert r.exit_code == 0, r.output
    return folder


def test_a_batchnorm_network_from_random_starts_runs_the_whole_flow(bn_silos):
    """fit-local folds each component's statistics (stored per component; ``/frozen`` the (0, 1) every model is
    built with; the affine parameters get the exact GGN diagonal); fuse runs every method with both statistics
    rules, reset on the server's inputs recorded in the global; evaluate runs every predictive."""
    folder = bn_silos
    art = posterior_fusion.load(folder / "k0.h5")
    assert art.metadata["batchnorm"] == "fold"
    assert art.metadata["curvature_blocks"]["blocks.0.n1.weight"] == "diag"
    channels = sum(m.num_features for _, m in batch_norms(art.model(0)))
    with h5py.File(folder / "k0.h5") as f:
        assert f["components/1/statistics"].shape == (2 * channels,)
        frozen = f["frozen"][()]
    assert set(np.unique(frozen)) == {0.0, 1.0}
    for comp in art.components:  # each component's own statistics: variances positive, not (0, 1)
        var = comp.statistics[variance_mask(art.model_spec)]
        assert var.numel() == channels and (var > 0).all() and not torch.allclose(var, torch.ones_like(var))
    k = [folder / "k0.h5", folder / "k1.h5"]
    for method in ("fedbens", "fedavg", "fisher-merge", "fedlpa", "regmean", "ensemble"):
        for rule in ("fold", "reset"):
            out = folder / f"g_{method}_{rule}.h5"
            r = run("fuse", *k, "--method", method, "--batchnorm-statistics", rule, "--unlabeled", folder / "server.h5",
                    "--out", out)
            assert r.exit_code == 0, r.output
            record = posterior_fusion.load(out).metadata["batchnorm_statistics"]
            assert record["rule"] == rule
            if rule == "reset":
                assert record["n"] == 100
    # the ensemble's members are the clients' components: each read back under its own statistics
    assert posterior_fusion.load(folder / "g_ensemble_reset.h5").metadata["batchnorm_statistics"][
        "members_under_own_statistics"] == 4
    fold_w = posterior_fusion.load(folder / "g_fedavg_fold.h5").members[0]
    reset_w = posterior_fusion.load(folder / "g_fedavg_reset.h5").members[0]
    assert not torch.equal(fold_w, reset_w)
    for predictive in ("map", "glm", "glm-last-layer", "mc"):
        r = run("evaluate", folder / "g_fedbens_reset.h5", "--data", folder / "s0.h5", "--predictive", predictive,
                "--samples", "3", "--json")
        assert r.exit_code == 0, r.output
    assert "BatchNorm statistics: reset" in run("inspect", folder / "g_fedbens_reset.h5").output
    # another structure captured again at the same MAPs keeps each component's statistics (they still hold)
    r = run("recapture", "--artifact", folder / "k0.h5", "--data", folder / "s0.h5", "--structure", "diag",
            "--out", folder / "r0.h5")
    assert r.exit_code == 0, r.output
    again = posterior_fusion.load(folder / "r0.h5")
    assert all(torch.equal(a.statistics, b.statistics) for a, b in zip(again.components, art.components))


def test_batchnorm_refusals_are_one_line_before_training(bn_silos, tmp_path, small_silo):
    """``batchnorm`` refuse and SWAG are refused before any training; reset without server inputs, or on
    clients that folded nothing, in one line; a stored negative variance is refused naming the file."""
    folder = bn_silos
    for extra, words in ((("--batchnorm", "refuse"), "refuse"), (("--swag",), "SWAG")):
        r = run("fit-local", "--data", folder / "s0.h5", "--model", "resnet20", "--model-kwargs", KW, "-M", "1",
                *extra, "--out", tmp_path / "x.h5")
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.output
        assert "component 1" not in r.output and not (tmp_path / "x.h5").exists()
    r = run("fuse", folder / "k0.h5", folder / "k1.h5", "--batchnorm-statistics", "reset", "--out", tmp_path / "g.h5")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "--unlabeled" in r.stderr, r.output
    write_silo(tmp_path / "m.h5", SiloData(small_silo.x[:60], small_silo.y[:60], "fmnist", 10))
    for c in range(2):
        assert run("fit-local", "--data", tmp_path / "m.h5", "--model", "mlp", "-M", "1", "--epochs", "1",
                   "--train-seed", c, "--out", tmp_path / f"m{c}.h5").exit_code == 0
    r = run("fuse", tmp_path / "m0.h5", tmp_path / "m1.h5", "--batchnorm-statistics", "reset", "--val", tmp_path / "m.h5",
            "--out", tmp_path / "g.h5")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "folded" in r.stderr and "m0.h5" in r.stderr, r.output
    bad = tmp_path / "bad.h5"
    bad.write_bytes((folder / "k0.h5").read_bytes())
    with h5py.File(bad, "a") as f:
        values = f["components/0/statistics"][()]
        values[-1] = -1.0  # the last layer's last variance
        f["components/0/statistics"][...] = values
    r = run("fuse", bad, folder / "k1.h5", "--method", "fedavg", "--out", tmp_path / "g.h5")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "negative variance" in r.stderr and "bad.h5" in r.stderr, \
        r.output


def test_a_batchnorm_global_exports_its_statistics(tmp_path, small_silo):
    """A BatchNorm model fused from random starting points: ``models()``' state_dict holds the statistics as the
    architecture's buffers, loads strict into a fresh architecture and predicts as ``predict``."""
    from click.testing import CliRunner
    from conftest import fit_artifact

    import posterior_fusion
    from posterior_fusion.cli.main import pfuse
    from posterior_fusion.models import ModelSpec

    kw = {"in_channels": 1, "width": 2, "norm": "batch"}
    for c in range(2):
        fit_artifact(tmp_path / f"c{c}.h5", SiloData(small_silo.x[c * 40:(c + 1) * 40], small_silo.y[c * 40:(c + 1) * 40],
                                                     "fmnist", 10), "diag", "resnet20", kw, mixtures=1, seed=c)
    assert CliRunner().invoke(pfuse, ["fuse", str(tmp_path / "c0.h5"), str(tmp_path / "c1.h5"), "--method", "fedavg",
                                      "--out", str(tmp_path / "g.h5")]).exit_code == 0
    g = posterior_fusion.load(tmp_path / "g.h5")
    state = g.models()[0].state_dict()
    assert any(k.endswith("running_var") for k in state)
    fresh = ModelSpec("resnet20", kw).architecture()
    fresh.load_state_dict(state, strict=True)
    x = torch.as_tensor(small_silo.x[100:120]).float()[:, None] / 255
    with torch.no_grad():
        torch.testing.assert_close(torch.softmax(fresh.eval()(x), -1), g.predict(x, raw=True), rtol=1e-4, atol=1e-5)
