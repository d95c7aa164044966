"""``nn.Embedding`` on the fast path: a table whose input holds one row per sample gets the exact GGN
diagonal (every structure), equal to a dense float64 reference; an embedding of positions computed once for
the batch keeps the prior alone; the linearised predictive and the whole CLI flow take the new block."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import dense_ggn_diagonal, install_fake_plugin, random_psd
from torch import nn

from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag, Diag, Kron
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.policy import block_policy, curvature_bytes
from posterior_fusion.models.jacobians import jacobian_problem
from posterior_fusion.models.layers import embedding_per_sample, unsupported_reason

VOCAB, LENGTH = 6, 5


class TokenNet(nn.Module):
    """Token ids (stored as floats) -> a token table (with a padding row) and, optionally, positions from
    ``arange`` (one table for the whole batch) -> LayerNorm -> mean over tokens -> Linear."""

    def __init__(self, positions: bool = True, classes: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 4, padding_idx=0)
        self.pos = nn.Embedding(LENGTH, 4) if positions else None
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x.long())
        if self.pos is not None:
            h = h + self.pos(torch.arange(x.shape[1], device=x.device))[None]
        return self.head(self.norm(torch.tanh(h)).mean(1))


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, LENGTH), generator=gen).double()
    return x, torch.randint(0, 3, (n,), generator=gen)


def _diagonal(curv) -> torch.Tensor:
    return torch.cat([b.diagonal() for b in curv.blocks])


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_a_per_sample_embedding_gets_the_exact_ggn_diagonal(structure):
    """The token table's block (padding row included: zero) equals the dense float64 GGN diagonal under every
    structure; the positional table (one for the batch, no layer rule) gets its exact GGN diagonal too, recorded as
    ``residual``; LayerNorm and the head are as before."""
    torch.manual_seed(0)
    model = TokenNet().double().eval()
    x, y = _tokens(24, 1)
    curv, how = capture(structure, model, x, y, 7)
    assert how == "fast"
    ref = dense_ggn_diagonal(model, x)
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    got = dict(zip(names, torch.split(_diagonal(curv), sizes)))
    want = dict(zip(names, torch.split(ref, sizes)))
    assert torch.allclose(got["tok.weight"], want["tok.weight"], rtol=1e-10, atol=1e-14)
    assert want["tok.weight"][4:].abs().max() > 1e-4 and got["tok.weight"][:4].abs().max() == 0  # padding row: none
    assert want["pos.weight"].abs().max() > 1e-4  # the data constrains it: not the prior alone
    assert torch.allclose(got["pos.weight"], want["pos.weight"], rtol=1e-10, atol=1e-14)
    assert torch.allclose(got["norm.weight"], want["norm.weight"], rtol=1e-10, atol=1e-14)
    policy = dict(block_policy(model, structure))
    assert policy["tok.weight"] == "diag" and policy["pos.weight"] == "residual"
    bare = TokenNet(positions=False)
    assert unsupported_reason(bare, x[:2].float()) is None  # flags its table
    assert curvature_bytes(model, structure) == curvature_bytes(bare, structure) + 4 * model.pos.weight.numel()
    if structure == "diag":
        assert torch.allclose(got["head.weight"], want["head.weight"], rtol=1e-10, atol=1e-14)


def test_the_embedding_flag_follows_the_batch_and_refuses_batch_dependent_tables():
    """An embedding is flagged per-sample only when its input follows the batch at two sizes; ``max_norm``
    (which rewrites the table in the forward pass) is refused in one line."""
    model = TokenNet()
    assert unsupported_reason(model, _tokens(2, 0)[0].float()) is None
    assert model.tok.pfuse_per_sample and not model.pos.pfuse_per_sample
    model.tok.max_norm = 1.0
    assert "max_norm" in unsupported_reason(model, _tokens(2, 0)[0].float())


def test_embedding_jacobians_and_the_glm_covariance_equal_the_full_jacobian_ones():
    """Per-sample embedding gradients equal autograd's; the structured GLM logit covariance of a token model
    (every parameter captured: no positional table) equals J Λ⁻¹ Jᵀ from autograd and the dense precision."""
    from posterior_fusion.layout import ParameterLayout
    from posterior_fusion.predictive import logit_moments

    gen = torch.Generator().manual_seed(3)
    table = nn.Embedding(VOCAB, 3, padding_idx=2).double()
    ids = torch.randint(0, VOCAB, (4, LENGTH), generator=gen)
    g = torch.randn(4, LENGTH, 3, generator=gen, dtype=torch.float64)
    ref = torch.stack([torch.autograd.grad((table(ids[n]) * g[n]).sum(), table.weight)[0].reshape(-1)
                       for n in range(4)])
    assert torch.allclose(embedding_per_sample(table, ids, g), ref, rtol=1e-12, atol=1e-14)

    class Spec:  # the part of ModelSpec logit_moments uses
        num_classes = 3

        def build(self):
            torch.manual_seed(0)
            return TokenNet(positions=False)

    spec = Spec()
    model = spec.build()
    x, _ = _tokens(5, 4)
    assert jacobian_problem(model.eval(), x[:2].float()) is None  # the structured path serves it
    layout = ParameterLayout.from_model(model)
    blocks = [Kron(random_psd(e.shape[0], gen), random_psd(math.prod(e.shape[1:]), gen)) if e.matrix_shape
              else Diag(torch.rand(e.size, generator=gen, dtype=torch.float64) + 0.1) for e in layout.entries]
    prec = BlockDiag(blocks).precision(0.5, 1.0)
    w = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    _, cov = logit_moments(spec, w, prec, x.float())
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    dmodel = spec.build().double()

    def f(flat):
        parts = torch.split(flat, [math.prod(s) for s in shapes])
        return torch.func.functional_call(dmodel, {n: t.reshape(s) for n, t, s in zip(names, parts, shapes)}, (x,))

    J = torch.autograd.functional.jacobian(f, w.double())  # (n, C, d)
    full = torch.einsum("ncd,de,nke->nck", J, torch.linalg.inv(prec.to_dense().double()), J)
    assert ((cov - full).norm() / full.norm()).item() < 1e-5


TOKENS = '''
import torch
from torch import nn


class Bag(nn.Module):
    """Token ids (stored as floats) -> a token table -> mean -> Linear."""

    def __init__(self, num_classes: int = 3, in_features: int = 5):
        super().__init__()
        self.tok = nn.Embedding(6, 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.tok(x.long())).mean(1))


def bag(num_classes: int = 3, in_features: int = 5) -> nn.Module:
    return Bag(num_classes, in_features)
'''


def test_a_token_model_runs_the_whole_flow(tmp_path, monkeypatch):
    """A model whose table is indexed by the silo's token ids: fit-local with each structure records the table's
    block as ``diag`` and announces no prior-only parameter; fusion and each predictive run; the label is
    learnable from the tokens, so the fused ensemble is above chance."""
    import posterior_fusion

    install_fake_plugin(tmp_path, monkeypatch, "bagplug", "0.1", "bag", TOKENS)
    rng = np.random.default_rng(0)
    for c in range(2):
        x = rng.integers(0, 6, (200, LENGTH))
        y = np.argmax(np.stack([(x == t).sum(1) for t in (1, 2, 3)], 1) + rng.random((200, 3)) * 0.5, 1)
        write_silo(tmp_path / f"s{c}.h5", SiloData(x.astype(np.float32), y.astype(np.int64), "tokens", 3))
    for structure in ("kron", "diag", "diag+full"):
        for c in range(2):
            r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / f"s{c}.h5"), "--model", "bag",
                                           "-M", "1", "--epochs", "5", "--structure", structure, "--train-seed", str(c),
                                           "--out", str(tmp_path / f"{structure}{c}.h5")])
            assert r.exit_code == 0 and "prior alone" not in r.stderr, r.output
        art = posterior_fusion.load(tmp_path / f"{structure}0.h5")
        assert art.metadata["curvature_blocks"]["tok.weight"] == "diag" and art.components[0].training["capture"] == "fast"
        assert art.components[0].curvature.diagonal()[:48].abs().max() > 0
    pair = [str(tmp_path / "kron0.h5"), str(tmp_path / "kron1.h5")]
    for method in ("fedbens", "fisher-merge", "ensemble"):
        r = CliRunner().invoke(pfuse, ["fuse", *pair, "--method", method, "--out", str(tmp_path / f"g_{method}.h5")])
        assert r.exit_code == 0, (method, r.output)
    for predictive in ("map", "glm", "mc"):
        r = CliRunner().invoke(pfuse, ["evaluate", str(tmp_path / "g_fedbens.h5"), "--data", str(tmp_path / "s0.h5"),
                                       "--predictive", predictive, "--json"])
        assert r.exit_code == 0, (predictive, r.output)


def test_token_ids_beyond_the_embedding_table_are_one_line_from_every_entry_point(tmp_path, monkeypatch):
    """A silo, a validation file or prediction inputs holding an id the model's table does not have (7 for a table
    of 6): one line naming the file (or the inputs) and the largest id, exit 2 — from fit-local, fuse --val,
    evaluate, predict and the Python API — never an IndexError."""
    import posterior_fusion
    from posterior_fusion.errors import ModelSpecError

    install_fake_plugin(tmp_path, monkeypatch, "bagplug2", "0.1", "bag", TOKENS)
    rng = np.random.default_rng(1)
    good = rng.integers(0, 6, (60, LENGTH)).astype(np.float32)
    bad = good.copy()
    bad[17, 2] = 7
    y = rng.integers(0, 3, 60)
    write_silo(tmp_path / "good.h5", SiloData(good, y, "tokens", 3))
    write_silo(tmp_path / "bad.h5", SiloData(bad, y, "tokens", 3))
    np.save(tmp_path / "bad.npy", bad)

    def one_line(r, name):
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.exit_code == 2 and len(errors) == 1 and name in errors[0] and "to 7" in errors[0], r.output
        assert "Traceback" not in r.output

    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "bad.h5"), "--model", "bag", "-M", "1",
                                   "--epochs", "1", "--structure", "diag", "--out", str(tmp_path / "x.h5")])
    one_line(r, "bad.h5")
    for c in range(2):
        assert CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "good.h5"), "--model", "bag", "-M", "1",
                                          "--epochs", "1", "--structure", "diag", "--train-seed", str(c),
                                          "--out", str(tmp_path / f"c{c}.h5")]).exit_code == 0
    pair = [str(tmp_path / "c0.h5"), str(tmp_path / "c1.h5")]
    one_line(CliRunner().invoke(pfuse, ["fuse", *pair, "--method", "fedbens", "--set", "steps=2", "--val",
                                        str(tmp_path / "bad.h5"), "--out", str(tmp_path / "g.h5")]), "bad.h5")
    assert CliRunner().invoke(pfuse, ["fuse", *pair, "--method", "fedavg", "--out", str(tmp_path / "g.h5")]).exit_code == 0
    one_line(CliRunner().invoke(pfuse, ["evaluate", str(tmp_path / "g.h5"), "--data", str(tmp_path / "bad.h5")]),
             "bad.h5")
    one_line(CliRunner().invoke(pfuse, ["predict", str(tmp_path / "g.h5"), "--data", str(tmp_path / "bad.h5"),
                                        "--out", str(tmp_path / "p.npy")]), "bad.h5")
    g = posterior_fusion.load(tmp_path / "g.h5")
    with pytest.raises(ModelSpecError, match="to 7"):
        g.predict(torch.as_tensor(bad), raw=True)
    assert g.predict(torch.as_tensor(good), raw=True).shape == (60, 3)


def test_inputs_beyond_float32_are_refused_without_a_warning_first(tmp_path, small_silo):
    """1e300 in the inputs of ``predict`` (the API): one refusal, no RuntimeWarning before it."""
    import warnings

    from conftest import fit_artifact

    import posterior_fusion
    from posterior_fusion.errors import ConfigError

    silo = SiloData(small_silo.x[:40, ::4, ::4].copy(), small_silo.y[:40], "fmnist", 10)
    fit_artifact(tmp_path / "c.h5", silo, "diag", kwargs={"in_features": 49, "hidden": 4}, mixtures=1)
    assert CliRunner().invoke(pfuse, ["fuse", str(tmp_path / "c.h5"), "--method", "fedavg",
                                      "--out", str(tmp_path / "g.h5")]).exit_code == 0
    g = posterior_fusion.load(tmp_path / "g.h5")
    x = np.ones((3, 7, 7))
    x[1, 2, 3] = 1e300
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for raw in (True, False):
            with pytest.raises(ConfigError, match="float32's range"):
                g.predict(x, raw=raw)
