"""The models people have: what the capture cannot take is refused before any training, in one line."""

from __future__ import annotations

from click.testing import CliRunner
from conftest import install_fake_plugin

from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo

TRANSFORMER = '''
import torch
from torch import nn


class TinyTransformer(nn.Module):
    """A stock-PyTorch transformer on 7x7 images: rows as tokens, nn.Embedding positions, one encoder layer."""

    def __init__(self, num_classes: int = 10, width: int = 8):
        super().__init__()
        self.patch = nn.Linear(7, width)
        self.pos = nn.Embedding(7, width)
        self.encoder = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        x = x.reshape(x.shape[0], 7, 7)
        h = self.patch(x) + self.pos(torch.arange(7, device=x.device))[None]
        return self.head(self.norm(self.encoder(h)).mean(1))


def tinytransformer(num_classes: int = 10, width: int = 8) -> nn.Module:
    return TinyTransformer(num_classes, width)
'''


TWICE = '''
from torch import nn


class Twice(nn.Module):
    """One Linear applied twice per pass: a layer the fast capture cannot take (its factors need one input each)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.shared = nn.Linear(49, 49)
        self.head = nn.Linear(49, num_classes)

    def forward(self, x):
        return self.head(self.shared(self.shared(x.reshape(x.shape[0], -1)).tanh()))


def twice(num_classes: int = 10) -> nn.Module:
    return Twice(num_classes)
'''


def test_a_model_the_capture_cannot_take_is_refused_before_training_not_after(tmp_path, monkeypatch, small_silo):
    """A layer that runs twice per pass: the fast capture cannot take it and never falls back to laplace-torch;
    ``fit-local`` says so in one line naming ``--capture laplace``, exit 2, before the first epoch (no training
    line), and writes nothing."""
    install_fake_plugin(tmp_path, monkeypatch, "twplug", "0.1", "twice", TWICE)
    silo = SiloData(small_silo.x[:64, ::4, ::4].copy(), small_silo.y[:64], "fmnist", 10)
    write_silo(tmp_path / "s.h5", silo)
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "twice",
                                   "-M", "1", "--epochs", "50", "--structure", "kron", "--out", str(tmp_path / "c.h5")])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "fast capture cannot take" in errors[0] and "--capture laplace" in errors[0], errors
    assert "nothing was trained" in errors[0] and "training" not in r.stderr.replace("nothing was trained", "")
    assert "Traceback" not in r.output and not (tmp_path / "c.h5").exists()


def test_a_stock_transformer_runs_the_whole_flow(tmp_path, monkeypatch, small_silo):
    """``nn.TransformerEncoderLayer`` (its ``nn.MultiheadAttention`` built as four Linear maps) on the fast
    path: fit-local with each structure, the layer policy recorded (attention projections K-FAC, LayerNorm
    diagonal, the positional nn.Embedding the prior alone, announced), every K-FAC fusion method, and each
    predictive of the fused posterior."""
    import posterior_fusion

    install_fake_plugin(tmp_path, monkeypatch, "ttplug", "0.1", "tinytransformer", TRANSFORMER)
    for c in range(2):
        write_silo(tmp_path / f"s{c}.h5", SiloData(small_silo.x[c * 64:(c + 1) * 64, ::4, ::4].copy(),
                                                   small_silo.y[c * 64:(c + 1) * 64], "fmnist", 10))
    for structure in ("kron", "diag", "diag+full"):
        for c in range(2):
            r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / f"s{c}.h5"), "--model",
                                           "tinytransformer", "-M", "1", "--epochs", "1", "--structure", structure,
                                           "--train-seed", str(c), "--out", str(tmp_path / f"{structure}{c}.h5")])
            assert r.exit_code == 0, r.output
            assert "prior alone" not in r.stderr, r.stderr  # the positions' table gets its GGN diagonal
        art = posterior_fusion.load(tmp_path / f"{structure}0.h5")
        assert art.components[0].training["capture"] == "fast"
    policy = posterior_fusion.load(tmp_path / "kron0.h5").metadata["curvature_blocks"]
    assert policy["encoder.self_attn.q_proj.weight"] == "kron" and policy["encoder.self_attn.out_proj.bias"] == "dense"
    assert policy["encoder.norm1.weight"] == "diag" and policy["pos.weight"] == "residual"
    pair = [str(tmp_path / "kron0.h5"), str(tmp_path / "kron1.h5")]
    for method in ("fedbens", "fedavg", "fisher-merge", "fedfisher", "regmean", "fedlpa", "hbfl", "ensemble"):
        r = CliRunner().invoke(pfuse, ["fuse", *pair, "--method", method, "--out", str(tmp_path / f"g_{method}.h5")])
        assert r.exit_code == 0, (method, r.output)
    for predictive in ("map", "glm", "glm-last-layer", "mc"):
        r = CliRunner().invoke(pfuse, ["evaluate", str(tmp_path / "g_fedbens.h5"), "--data", str(tmp_path / "s0.h5"),
                                       "--predictive", predictive, "--json"])
        assert r.exit_code == 0, (predictive, r.output)


def test_attention_kfac_equals_curvlinops():
    """K-FAC (expand and reduce, exact GGN) of a self-attention block built from nn.MultiheadAttention equals
    curvlinops' factors (through laplace-torch's backend, float64): its projections share their weights over
    the tokens, expand and reduce differ there."""
    import torch
    from torch import nn

    from posterior_fusion.local.capture import capture
    from posterior_fusion.models.attention import linear_attention

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            h = self.embed(x)
            return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    model = linear_attention(Block()).double().eval()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 5, 3, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g)
    out = {}
    refs = {kfac: capture("kron", model, x, y, 4, "exact", "laplace", kfac=kfac)[0] for kfac in ("expand", "reduce")}
    for kfac in ("expand", "reduce"):
        fast, how = capture("kron", model, x, y, 4, "exact", "fast", kfac=kfac)
        ref = refs[kfac]
        assert how == "fast" and len(fast.blocks) == len(ref.blocks) == 12
        scale = max(t.norm().item() for blk in ref.blocks for t in blk.to_tensors().values())
        # under reduce the key projection is captured with expand (reduce's output factor vanishes there)
        ref = type(ref)([refs["expand"].blocks[k] if kfac == "reduce" and k in (4, 5) else b for k, b in enumerate(ref.blocks)])
        for a, b in zip(ref.blocks, fast.blocks, strict=True):
            for ta, tb in zip(a.to_tensors().values(), b.to_tensors().values(), strict=True):
                # the key projection's bias has no curvature (a softmax ignores a shift of every score in a
                # row): both factors are rounding noise there, compared against the largest factor
                assert (ta - tb).norm().item() < 1e-10 * max(ta.norm().item(), 1e-12 * scale), kfac
        out[kfac] = fast
    q_expand, q_reduce = out["expand"].blocks[2].to_tensors(), out["reduce"].blocks[2].to_tensors()
    assert ((q_expand["kron_A"] - q_reduce["kron_A"]).norm() / q_expand["kron_A"].norm()).item() > 1e-3
    # the key weights' curvature is not the prior alone: its trace within a factor 10 of the exact GGN block's
    from conftest import dense_ggn_diagonal

    exact = dense_ggn_diagonal(model, x)
    offsets = torch.cumsum(torch.tensor([0] + [p.numel() for p in model.parameters()]), 0)
    k_exact = float(exact[offsets[4]: offsets[5]].sum())
    for kfac in ("expand", "reduce"):
        blk = out[kfac].blocks[4].to_tensors()
        k_stored = float(torch.trace(blk["kron_B"]) * torch.trace(blk["kron_A"]))
        assert k_exact / 10 < k_stored < 10 * k_exact, (kfac, k_stored, k_exact)
    assert float(torch.trace(refs["reduce"].blocks[4].to_tensors()["kron_B"])) < 1e-12 * k_exact  # what reduce gives


def test_the_transformer_glm_covariance_is_the_full_jacobian_one():
    """The GLM logit covariance of a transformer with attention (the structured, layer-by-layer path) equals
    J Λ⁻¹ Jᵀ from autograd Jacobians and the dense precision, float64, to 1e-5 relative."""
    import math

    import torch
    from conftest import random_psd
    from torch import nn

    from posterior_fusion.curvature import BlockDiag, Diag, Kron
    from posterior_fusion.layout import ParameterLayout
    from posterior_fusion.predictive import logit_moments

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Linear(7, 8)
            self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.encoder(self.patch(x.reshape(x.shape[0], 7, 7))).mean(1))

    class Spec:  # the part of ModelSpec logit_moments uses
        num_classes = 3

        def build(self):
            from posterior_fusion.models.attention import linear_attention

            torch.manual_seed(0)
            return linear_attention(Enc())

    spec = Spec()
    model = spec.build()
    layout = ParameterLayout.from_model(model)
    gen = torch.Generator().manual_seed(3)
    blocks = [Kron(random_psd(e.shape[0], gen), random_psd(math.prod(e.shape[1:]), gen)) if e.matrix_shape
              else Diag(torch.rand(e.size, generator=gen, dtype=torch.float64) + 0.1) for e in layout.entries]
    prec = BlockDiag(blocks).precision(0.5, 1.0)
    w = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    x = torch.randn(5, 49, generator=gen)
    _, cov = logit_moments(spec, w, prec, x)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    dmodel = spec.build().double()

    def f(flat):
        parts = torch.split(flat, [math.prod(s) for s in shapes])
        return torch.func.functional_call(dmodel, {n: t.reshape(s) for n, t, s in zip(names, parts, shapes)},
                                          (x.double(),))

    J = torch.autograd.functional.jacobian(f, w.double())  # (n, C, d)
    ref = torch.einsum("ncd,de,nke->nck", J, torch.linalg.inv(prec.to_dense().double()), J)
    assert ((cov - ref).norm() / ref.norm()).item() < 1e-5


EMBEDDED = '''
import torch
from torch import nn


class Embedded(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.patch = nn.Linear(7, 8)
        self.pos = nn.Embedding(7, 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        h = self.patch(x.reshape(x.shape[0], 7, 7)) + self.pos(torch.arange(7, device=x.device))[None]
        return self.head(torch.relu(h).mean(1))


def embedded(num_classes: int = 10) -> nn.Module:
    return Embedded(num_classes)
'''


def test_a_parameter_outside_every_layer_rule_gets_its_exact_ggn_diagonal(tmp_path, monkeypatch, small_silo):
    """An ``nn.Embedding`` called with position ids (no layer rule covers it) is no longer the prior alone:
    ``fit-local`` warns of nothing, records it as ``residual``, and its block equals the dense float64 GGN
    diagonal."""
    import torch
    from conftest import dense_ggn_diagonal

    import posterior_fusion
    from posterior_fusion.local.capture import capture

    install_fake_plugin(tmp_path, monkeypatch, "embplug", "0.1", "embedded", EMBEDDED)
    write_silo(tmp_path / "s.h5", SiloData(small_silo.x[:64, ::4, ::4].copy(), small_silo.y[:64], "fmnist", 10))
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "embedded", "-M", "1",
                                   "--epochs", "1", "--out", str(tmp_path / "c.h5")])
    assert r.exit_code == 0 and "prior alone" not in r.stderr, r.output
    art = posterior_fusion.load(tmp_path / "c.h5")
    assert art.metadata["curvature_blocks"]["pos.weight"] == "residual"
    torch.manual_seed(0)
    model = posterior_fusion.models.members.build_model(art.model_spec, art.components[0].map).double().eval()
    x = torch.randn(12, 7, 7, dtype=torch.float64)
    y = torch.randint(0, 10, (12,))
    curv, _ = capture("kron", model, x, y, 5)
    names = [n for n, _ in model.named_parameters()]
    block = curv.blocks[names.index("pos.weight")].diagonal()
    ref = dense_ggn_diagonal(model, x)
    sizes = [p.numel() for p in model.parameters()]
    want = dict(zip(names, torch.split(ref, sizes)))["pos.weight"]
    assert want.abs().max() > 1e-6 and torch.allclose(block.double(), want, rtol=1e-9, atol=1e-14)


def test_fit_local_states_the_artifact_size_before_training(tmp_path, small_silo):
    """The header line (before the first epoch) states the artifact's size per component; it matches the
    written artifact's MAP and curvature bytes within 5 % for each structure."""
    import re

    import posterior_fusion
    from posterior_fusion.summary import summarize

    write_silo(tmp_path / "s.h5", SiloData(small_silo.x[:64], small_silo.y[:64], "fmnist", 10))
    for structure in ("kron", "diag", "diag+full"):
        out = tmp_path / f"{structure}.h5"
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "lenet", "-M", "1",
                                       "--epochs", "1", "--structure", structure, "--out", str(out)])
        assert r.exit_code == 0, r.output
        header = next(line for line in r.stderr.splitlines() if "artifact about" in line)
        stated = float(re.search(r"artifact about ([0-9.e+-]+) MiB per component", header).group(1)) * 2**20
        comp = summarize(posterior_fusion.load(out))["components"][0]
        actual = comp["curvature_bytes"] + 4 * posterior_fusion.load(out).layout.dim
        assert abs(stated - actual) <= 0.05 * actual, (structure, stated, actual)


def test_a_stock_transformer_s_state_dict_is_a_base(tmp_path, monkeypatch):
    """A pretrained stock transformer's parameters (``in_proj_weight`` packed) read as a base: the model built
    from it (attention as four Linear maps) computes what the stock model computes."""
    import torch
    from safetensors.torch import save_file
    from torch.nn.utils import vector_to_parameters

    from posterior_fusion.local.init import read_base
    from posterior_fusion.models import ModelSpec

    install_fake_plugin(tmp_path, monkeypatch, "ttplug2", "0.1", "tinytransformer", TRANSFORMER)
    spec = ModelSpec("tinytransformer", {})
    torch.manual_seed(5)
    stock = spec._construct().eval()  # the plugin's module as it is, nn.MultiheadAttention inside
    save_file({k: v.detach().clone() for k, v in stock.named_parameters()}, str(tmp_path / "b.safetensors"))
    _, w, _ = read_base(spec, tmp_path / "b.safetensors")
    model = spec.build().eval()
    vector_to_parameters(w, model.parameters())
    x = torch.randn(4, 49)
    torch.testing.assert_close(model(x), stock(x), rtol=1e-5, atol=1e-5)


def test_batchnorm_fine_tuned_from_a_base_keeps_its_statistics_frozen(tmp_path, small_silo):
    """A BatchNorm ResNet fine-tuned from a pretrained base: its running statistics are the base's, frozen bit for
    bit — stored once per artifact, untouched by training (evaluation mode throughout), the fused model's the
    same — while its affine parameters get the exact GGN diagonal; the same model from random starting points
    under `batchnorm` refuse, or a base without statistics, is refused in one line before training."""
    import h5py
    import torch
    from safetensors.torch import load_file, save_file

    import posterior_fusion
    from posterior_fusion.models import builtin

    torch.manual_seed(0)
    net = builtin.resnet20(in_channels=1, width=4, norm="batch").train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, 1, 28, 28) + 0.5)  # statistics that are not the initial ones
    posterior_fusion.write_base(net, tmp_path / "base.safetensors")
    stats = {n: b for n, b in net.named_buffers() if n.endswith(("running_mean", "running_var"))}
    for c in range(2):
        write_silo(tmp_path / f"s{c}.h5", SiloData(small_silo.x[c * 60:(c + 1) * 60], small_silo.y[c * 60:(c + 1) * 60],
                                                   "fmnist", 10))
    kw = '{"in_channels": 1, "width": 4, "norm": "batch"}'
    run = lambda *a: CliRunner().invoke(pfuse, [str(v) for v in a])  # noqa: E731
    r = run("fit-local", "--data", tmp_path / "s0.h5", "--model", "resnet20", "--model-kwargs", kw, "-M", "1",
            "--epochs", "50", "--batchnorm", "refuse", "--out", tmp_path / "x.h5")
    assert r.exit_code == 2 and "BatchNorm" in r.stderr and "pretrained base" in r.stderr and r.stderr.count("\n") == 1
    assert "training" not in r.stderr and not (tmp_path / "x.h5").exists()
    assert run("init", "--model", "resnet20", "--model-kwargs", kw, "-M", "1", "--base", tmp_path / "base.safetensors",
               "--out", tmp_path / "i.h5").exit_code == 0
    for structure in ("kron", "diag"):
        for c in range(2):
            r = run("fit-local", "--data", tmp_path / f"s{c}.h5", "--init", tmp_path / "i.h5", "--epochs", "2",
                    "--structure", structure, "--train-seed", c, "--out", tmp_path / f"{structure}{c}.h5")
            assert r.exit_code == 0, r.output
    art = posterior_fusion.load(tmp_path / "kron0.h5")
    assert art.metadata["curvature_blocks"]["blocks.0.n1.weight"] == "diag"
    with h5py.File(tmp_path / "kron0.h5") as f:
        assert torch.equal(torch.from_numpy(f["frozen"][()]), torch.cat([t.reshape(-1) for t in stats.values()]))
    for method in ("fedbens", "fedavg"):
        assert run("fuse", tmp_path / "kron0.h5", tmp_path / "kron1.h5", "--method", method,
                   "--out", tmp_path / f"g_{method}.h5").exit_code == 0
        g = posterior_fusion.load(tmp_path / f"g_{method}.h5")
        buffers = dict(g.models()[0].named_buffers())  # the exported architecture's statistics: the base's
        assert all(torch.equal(buffers[n], t) for n, t in stats.items())
        model = posterior_fusion.models.members.build_model(g.model_spec, g.members[0])
        model.train()  # the spec's own model keeps them frozen: evaluation mode whatever is asked
        assert not any(m.training for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    for predictive in ("map", "glm"):
        r = run("evaluate", tmp_path / "g_fedbens.h5", "--data", tmp_path / "s0.h5", "--predictive", predictive, "--json")
        assert r.exit_code == 0, r.output
    bare = load_file(str(tmp_path / "base.safetensors"))
    save_file({k: v for k, v in bare.items() if "running" not in k}, str(tmp_path / "nostats.safetensors"))
    r = run("init", "--model", "resnet20", "--model-kwargs", kw, "-M", "1", "--base", tmp_path / "nostats.safetensors",
            "--out", tmp_path / "j.h5")
    assert r.exit_code == 2 and "running statistics" in r.stderr and r.stderr.count("\n") == 1, r.output


def test_merging_a_batchnorm_models_adapters_keeps_the_bases_statistics(tmp_path, small_silo):
    """``recapture --merge`` of a BatchNorm ResNet fine-tuned with LoRA from a base whose statistics are not the
    initial ones: the merged artifact of the whole architecture keeps those statistics frozen (its /frozen, its
    models' buffers), so its networks predict exactly as the adapters' did."""
    import h5py
    import torch

    import posterior_fusion
    from posterior_fusion.data.silo import read_silo
    from posterior_fusion.models import builtin

    torch.manual_seed(0)
    net = builtin.resnet20(in_channels=1, width=4, norm="batch").train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(16, 1, 28, 28) * 2 + 1.5)  # statistics far from the initial (0, 1)
    posterior_fusion.write_base(net, tmp_path / "base.safetensors")
    stats = {n: b.clone() for n, b in net.named_buffers() if n.endswith(("running_mean", "running_var"))}
    write_silo(tmp_path / "s0.h5", SiloData(small_silo.x[:60], small_silo.y[:60], "fmnist", 10))
    kw = '{"in_channels": 1, "width": 4, "norm": "batch"}'
    run = lambda *a: CliRunner().invoke(pfuse, [str(v) for v in a])  # noqa: E731
    assert run("init", "--model", "resnet20", "--model-kwargs", kw, "-M", "1", "--base", tmp_path / "base.safetensors",
               "--out", tmp_path / "i.h5").exit_code == 0
    r = run("fit-local", "--data", tmp_path / "s0.h5", "--init", tmp_path / "i.h5", "--finetune", "lora:1",
            "--structure", "diag", "--epochs", "1", "--out", tmp_path / "c0.h5")
    assert r.exit_code == 0, r.output
    r = run("recapture", "--artifact", tmp_path / "c0.h5", "--data", tmp_path / "s0.h5", "--merge", "--out", tmp_path / "m0.h5")
    assert r.exit_code == 0, r.output
    lora, merged = posterior_fusion.load(tmp_path / "c0.h5"), posterior_fusion.load(tmp_path / "m0.h5")
    with h5py.File(tmp_path / "m0.h5") as f:
        assert torch.equal(torch.from_numpy(f["frozen"][()]), torch.cat([t.reshape(-1) for t in stats.values()]))
    buffers = dict(merged.model(0).named_buffers())
    assert all(torch.equal(buffers[n], t) for n, t in stats.items())
    x = read_silo(tmp_path / "s0.h5").x
    torch.testing.assert_close(merged.predict(x), lora.predict(x), rtol=1e-4, atol=1e-5)


def test_the_builtin_transformer_is_stock_pytorch_on_the_fast_path():
    """``transformer``: rows as tokens, stock nn.TransformerEncoder layers (attention as four Linear maps when
    built), fixed sinusoidal positions (no parameter, no state in the artifact); every parameter gets a block
    of the fast capture (none the prior alone)."""
    import torch

    from posterior_fusion.local.capture import capture
    from posterior_fusion.local.capture.policy import block_policy
    from posterior_fusion.models import ModelSpec, non_parameter_state
    from posterior_fusion.models.attention import LinearAttention

    spec = ModelSpec("transformer", {"row_size": 8, "width": 16, "layers": 2, "heads": 4})
    model = spec.build().eval()
    assert sum(isinstance(m, LinearAttention) for m in model.modules()) == 2 and non_parameter_state(model) is None
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    assert model(x).shape == (6, 10)
    assert all(kind != "prior" for _, kind in block_policy(model, "kron"))
    curv, how = capture("kron", model, x, y, 4)
    assert how == "fast" and curv.dim == sum(p.numel() for p in model.parameters())


def test_a_layer_whose_input_is_not_one_row_per_sample_is_refused_by_the_fast_capture():
    """A Linear run once for the whole batch (its output broadcast over the samples), or a sequence-first
    transformer: per-sample curvature cannot be taken there, so the fast capture refuses the model in one line
    instead of treating tokens as samples; a batch-first transformer passes."""
    import pytest
    import torch
    from torch import nn

    from posterior_fusion.errors import ConfigError
    from posterior_fusion.local.capture import capture
    from posterior_fusion.models.attention import linear_attention
    from posterior_fusion.models.layers import unsupported_reason

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.query = nn.Linear(3, 8)
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(x + self.query(torch.eye(3)[:2]).mean(0))

    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    assert "one row per sample" in unsupported_reason(Shared(), x[:2])
    with pytest.raises(ConfigError, match="one row per sample"):
        capture("kron", Shared(), x, y, 4)
    first = linear_attention(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=False), 1,
                                                   enable_nested_tensor=False)).eval()
    assert "one row per sample" in unsupported_reason(first, torch.randn(2, 5, 8))
    batch_first = linear_attention(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1,
                                                         enable_nested_tensor=False)).eval()
    assert unsupported_reason(batch_first, torch.randn(2, 5, 8)) is None


DROPOUT = '''
from torch import nn


def dropnet(num_classes: int = 10, in_features: int = 49):
    """An MLP with dropout between its layers, as most people's models have."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, 16), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(16, num_classes))
'''


def test_a_dropout_model_predicts_evaluates_and_selects_deterministically(tmp_path, monkeypatch, small_silo):
    """Every evaluation runs the members in evaluation mode: with dropout in the model, ``predict`` (the API and
    the CLI), ``evaluate`` and ``fuse --val``'s selection give bit-identical results run after run, and equal a
    plain ``eval()`` forward pass of the member."""
    import torch

    import posterior_fusion
    from posterior_fusion.models.members import build_model

    install_fake_plugin(tmp_path, monkeypatch, "dropplug", "0.1", "dropnet", DROPOUT)
    for c in range(2):
        write_silo(tmp_path / f"s{c}.h5", SiloData(small_silo.x[c * 60:(c + 1) * 60, ::4, ::4].copy(),
                                                   small_silo.y[c * 60:(c + 1) * 60], "fmnist", 10))
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / f"s{c}.h5"), "--model", "dropnet",
                                       "-M", "2", "--epochs", "2", "--structure", "diag", "--train-seed", str(c),
                                       "--out", str(tmp_path / f"c{c}.h5")])
        assert r.exit_code == 0, r.output
    val = SiloData(small_silo.x[200:260, ::4, ::4].copy(), small_silo.y[200:260], "fmnist", 10)
    write_silo(tmp_path / "val.h5", val)
    kept = []
    for k in range(2):
        out = tmp_path / f"g{k}.h5"
        r = CliRunner().invoke(pfuse, ["fuse", str(tmp_path / "c0.h5"), str(tmp_path / "c1.h5"), "--method", "fedbens",
                                       "--set", "steps=40", "--set", "val_every=10", "--val", str(tmp_path / "val.h5"),
                                       "--out", str(out)])
        assert r.exit_code == 0, r.output
        g = posterior_fusion.load(out)
        kept.append([h[-1]["step"] for h in g.metadata["history"]] if "history" in g.metadata else None)
        kept.append(torch.stack(list(g.members)))
    assert kept[0] == kept[2] and torch.equal(kept[1], kept[3])
    g = posterior_fusion.load(tmp_path / "g0.h5")
    x = torch.as_tensor(val.x[:20]).float()
    first, second = g.predict(x), g.predict(x)
    assert torch.equal(first, second)
    member = build_model(g.model_spec, g.members[0])
    assert not member.training
    evals = [CliRunner().invoke(pfuse, ["evaluate", str(tmp_path / "g0.h5"), "--data", str(tmp_path / "val.h5"),
                                        "--json"]).stdout for _ in range(2)]
    assert evals[0] == evals[1] and evals[0]


BROKEN = '''
import torch
from torch import nn


def raises(num_classes: int = 10):
    raise RuntimeError("no weights here")


def not_a_module(num_classes: int = 10):
    return "a model"


class Pair(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.fc = nn.Linear(49, num_classes)

    def forward(self, x):
        out = self.fc(x.flatten(1))
        return out, out


def pair(num_classes: int = 10):
    return Pair(num_classes)


class Fails(Pair):
    def forward(self, x):
        raise KeyError("a missing key")


def fails(num_classes: int = 10):
    return Fails(num_classes)


def bn1d(num_classes: int = 10):
    return nn.Sequential(nn.Flatten(), nn.Linear(49, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, num_classes))
'''


def test_plugins_are_held_to_the_model_contract_before_any_training(tmp_path, monkeypatch, small_silo):
    """A builder that raises, one that returns no module, a forward that returns a tuple or raises: one line each,
    naming the model, before any training; a BatchNorm1d model meeting a final batch of one trains."""
    site = tmp_path / "site"
    (site / "brokenplug").mkdir(parents=True)
    (site / "brokenplug" / "__init__.py").write_text(BROKEN)
    dist = site / "brokenplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    names = ("raises", "not_a_module", "pair", "fails", "bn1d")
    (dist / "entry_points.txt").write_text("[posterior_fusion.models]\n" + "".join(f"{n} = brokenplug:{n}\n" for n in names))
    monkeypatch.syspath_prepend(str(site))
    silo = SiloData(small_silo.x[:65, ::4, ::4].copy(), small_silo.y[:65], "fmnist", 10)  # 65 = 2 x 32 + 1
    write_silo(tmp_path / "s.h5", silo)
    for name, words in (("raises", "builder failed"), ("not_a_module", "not a torch.nn.Module"),
                        ("pair", "one tensor of logits"), ("fails", "forward failed")):
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", name, "-M", "1",
                                       "--epochs", "1", "--structure", "diag", "--out", str(tmp_path / "x.h5")])
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.exit_code == 2 and len(errors) == 1 and words in errors[0] and name in errors[0], (name, r.output)
        assert "Traceback" not in r.output and "training" not in r.stderr and not (tmp_path / "x.h5").exists()
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "bn1d", "-M", "1",
                                   "--epochs", "1", "--batch-size", "32", "--structure", "diag",
                                   "--out", str(tmp_path / "bn.h5")])
    assert r.exit_code == 0, r.output
