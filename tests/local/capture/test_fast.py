"""The fast curvature capture against laplace-torch (the oracle): K-FAC factors, diagonal and
last-layer full GGN on LeNet, the paper's CNN, an MLP with biases and a plugin-registered
architecture (strided/padded convolution, tanh, average pooling), in float32 (≤ 1e-5 relative)
and float64 (≤ 1e-10); the MC variant is unbiased; unsupported models fall back to laplace-torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import install_fake_plugin
from torch import nn

from posterior_fusion.errors import ConfigError
from posterior_fusion.local.capture import capture, inputs, outputs
from posterior_fusion.local.capture import gram as gram_module
from posterior_fusion.local.capture.gram import CHUNK_COLUMNS
from posterior_fusion.models import ModelSpec, jacobians, layers, maxpool
from posterior_fusion.models.layers import unsupported_reason

PLUGIN = '''
from torch import nn


def stridenet(num_classes: int = 10, channels: int = 4) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, channels, 3, stride=2, padding=1), nn.Tanh(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(channels * 49, 16), nn.Tanh(), nn.Linear(16, num_classes))
'''


@pytest.fixture
def plugin_spec(tmp_path, monkeypatch) -> ModelSpec:
    install_fake_plugin(tmp_path, monkeypatch, "strideplug", "0.1", "stridenet", PLUGIN)
    spec = ModelSpec("stridenet", {"channels": 3})
    assert spec.provider == "strideplug==0.1"
    return spec


def _data(name: str, fmnist_train, n: int, dtype: torch.dtype):
    x, y = fmnist_train
    if name == "cnn":  # 32x32 RGB inputs
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, 3, 32, 32, generator=g, dtype=dtype), torch.as_tensor(y[:n]).long()
    xt = torch.as_tensor(x[:n], dtype=dtype)
    return (xt.unsqueeze(1) if xt.ndim == 3 else xt), torch.as_tensor(y[:n]).long()


def _compare(spec: ModelSpec, fmnist_train, structure: str, dtype: torch.dtype, n: int, tol: float):
    torch.manual_seed(0)
    model = spec.build().to(dtype).eval()
    name = spec.name
    x, y = _data(name, fmnist_train, n, dtype)
    ref, how_ref = capture(structure, model, x, y, 64, "exact", method="laplace")
    new, how_new = capture(structure, model, x, y, 64, "exact", method="fast")
    assert (how_ref, how_new) == ("laplace", "fast")
    assert [type(b) for b in ref.blocks] == [type(b) for b in new.blocks]
    for rb, nb in zip(ref.blocks, new.blocks):
        rt, nt = rb.to_tensors(), nb.to_tensors()
        assert rt.keys() == nt.keys()
        for key in rt:
            a, b = rt[key].double(), nt[key].double()
            # relative error in the Frobenius norm: laplace-torch's float32 factors are themselves
            # up to 1.4e-5 off entrywise (relative to the largest entry) from a float64 capture,
            # the fast path's ≤ 1e-7 (float64 accumulation); see test_fast_float32_is_closer_...
            rel = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
            # laplace-torch's float64 last-layer GGN is itself off by ~2e-8 (against the dense
            # Jacobian reference below, which the fast path meets to 1e-12)
            limit = max(tol, 1e-7) if key == "dense" and structure == "diag+full" else tol
            assert rel <= limit, f"{name} {structure} {key}: relative error {rel:.2e} > {limit:.0e}"


MODELS = [("lenet", {}), ("lenet", {"bias": True}), ("cnn", {"bias": True}), ("mlp", {"hidden": 24})]


def test_exact_columns_are_a_rank_c_minus_1_square_root_of_the_ce_hessian():
    """Σ_i s_i s_iᵀ = diag(p) − p pᵀ with C − 1 columns, against float64 (confident samples included)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.cat([torch.randn(40, 10, generator=gen) * 4, torch.tensor([[30.0] + [0.0] * 8 + [-20.0]])])
    S = jacobians.backprop_columns(logits, "exact", None)
    assert S.shape == (9, 41, 10)
    p = logits.double().softmax(-1)
    H = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    SS = torch.einsum("rmc,rmd->mcd", S.double(), S.double())
    scale = torch.diagonal(H, dim1=1, dim2=2).sqrt()  # error relative to √(H_ii H_jj), the entries' natural size
    assert ((SS - H).abs() / (scale[:, :, None] * scale[:, None, :])).max() < 2e-3
    torch.testing.assert_close(SS[:40], H[:40], rtol=0, atol=1e-6)


@pytest.mark.parametrize("layer,shape,chunk", [
    (nn.Conv2d(2, 4, 3), (5, 4, 6, 7), CHUNK_COLUMNS),  # channels <= positions: per-sample products
    (nn.Conv2d(2, 9, 3), (5, 9, 2, 3), CHUNK_COLUMNS),  # more channels than positions: column chunks
    (nn.Conv2d(2, 4, 3), (5, 4, 6, 7), 16),  # more positions than a chunk: column chunks
    (nn.Linear(3, 4), (50, 4), 16),
    (nn.Linear(3, 4), (6, 5, 4), CHUNK_COLUMNS),  # a sequence of positions
])
def test_output_gram_equals_float64_product(monkeypatch, layer, shape, chunk):
    """Σ g gᵀ over samples and positions, whichever way it is summed, against one float64 product."""
    monkeypatch.setattr(gram_module, "CHUNK_COLUMNS", chunk)
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    cols = (g.transpose(0, 1).reshape(shape[1], -1) if isinstance(layer, nn.Conv2d) else g.reshape(-1, shape[-1]).T)
    ref = cols.double() @ cols.double().T
    torch.testing.assert_close(outputs.output_gram(layer, g), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kernel,padding,dilation,size", [
    (3, 1, 1, (9, 9)), (3, 0, 1, (8, 11)), (3, 3, 1, (6, 7)), (5, 2, 1, (10, 9)), (3, 1, 2, (9, 12)),
    ((3, 5), (1, 0), (2, 1), (12, 13)), ((1, 3), (0, 1), 1, (5, 6)), (4, 1, 1, (9, 8))])
@pytest.mark.parametrize("chunk", [CHUNK_COLUMNS, 7])
def test_shifted_conv_input_gram_equals_the_patches(monkeypatch, kernel, padding, dilation, size, chunk):
    """The stride-1 input factor from one product per displacement (plus boundary strips) equals the
    Gram of the unfolded patches, in float64 to rounding and in float32 to float32 accuracy: same,
    valid and over-padding, dilation, non-square and even kernels, chunked sums."""
    monkeypatch.setattr(gram_module, "CHUNK_COLUMNS", chunk)
    conv = nn.Conv2d(3, 4, kernel, padding=padding, dilation=dilation)
    x = torch.randn(5, 3, *size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    X = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride).transpose(0, 1).reshape(
        3 * conv.kernel_size[0] * conv.kernel_size[1], -1)
    gram, positions = inputs._conv_input_gram_shifted(conv, x)
    assert positions * 5 == X.shape[1]
    torch.testing.assert_close(gram, X @ X.T, rtol=1e-12, atol=1e-10)
    gram32, _ = inputs._conv_input_gram_shifted(conv, x.float())
    torch.testing.assert_close(gram32, X @ X.T, rtol=1e-5, atol=1e-4)


def test_the_shifted_gram_is_chosen_only_where_it_pays():
    """The rule's choices where the measured winner is clear (``docs/benchmarks.md``); a curvature batch of 256."""
    x = torch.zeros(256, 16, 28, 28)
    assert inputs._shift_gram_pays(nn.Conv2d(16, 16, 3, padding=1), x)
    assert not inputs._shift_gram_pays(nn.Conv2d(16, 16, 3, padding=1, stride=2), x)
    assert not inputs._shift_gram_pays(nn.Conv2d(16, 16, 1), x)
    # one channel, a 5x5 kernel without padding (hundreds of boundary strips) or a batch of 4: patches are cheaper
    assert not inputs._shift_gram_pays(nn.Conv2d(16, 16, 3, padding=1), x[:4])
    assert not inputs._shift_gram_pays(nn.Conv2d(1, 16, 3, padding=1), x[:, :1])
    assert not inputs._shift_gram_pays(nn.Conv2d(6, 16, 5), x[:, :6, :12, :12])


def test_off_the_cpu_the_input_factor_is_the_patches_gram():
    """The pixel and shifted paths pay on a CPU only; an input elsewhere (here the meta device: the rule
    reads shapes and the device alone) takes the patches' GEMMs, for the layers where the CPU takes each."""
    conv, pixel = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(1, 4, 3, padding=1)
    x, small = torch.zeros(256, 16, 28, 28), torch.zeros(256, 1, 6, 6)
    assert inputs.input_gram_path(conv, x) == "shifted" and inputs.input_gram_path(pixel, small) == "pixel"
    assert inputs.input_gram_path(conv, x.to("meta")) == "patches"
    assert inputs.input_gram_path(pixel, small.to("meta")) == "patches"
    assert inputs.input_gram_path(nn.Linear(3, 2), torch.zeros(4, 3)) == "patches"


@pytest.mark.parametrize("structure", ["kron", "diag", "diag+full"])
@pytest.mark.parametrize("name,kwargs", MODELS)
def test_fast_equals_laplace_float32(fmnist_train, name, kwargs, structure):
    _compare(ModelSpec(name, kwargs), fmnist_train, structure, torch.float32, 48 if name == "cnn" else 200, 1e-5)


def test_fast_float32_is_closer_to_float64_than_laplace(fmnist_train, plugin_spec):
    """Entrywise (max-norm) error of the float32 K-FAC factors against a float64 capture: the
    fast path's is under 1e-5 and of the order of laplace-torch's (at most 1.5 times it: which of
    the two is smaller depends on the BLAS — here the fast path's, on an H100 machine's CPU with
    torch 2.11 laplace-torch's, 1.7e-7 against 2.0e-7)."""
    torch.manual_seed(0)
    model = plugin_spec.build().eval()
    x, y = _data("stridenet", fmnist_train, 150, torch.float32)
    model64 = plugin_spec.build()
    model64.load_state_dict(model.state_dict())
    truth, _ = capture("kron", model64.double().eval(), x.double(), y, 64, "exact", method="fast")
    for method in ("fast", "laplace"):
        curv, _ = capture("kron", model, x, y, 64, "exact", method=method)
        worst = max(((b.to_tensors()[k].double() - t.to_tensors()[k]).abs().max() / t.to_tensors()[k].abs().max()).item()
                    for b, t in zip(curv.blocks, truth.blocks) for k in t.to_tensors())
        if method == "fast":
            assert worst < 1e-5, worst
            fast_worst = worst
        else:  # laplace-torch sums whole batches in float32; the fast path sums chunks in float64
            assert fast_worst <= 1.5 * worst, (worst, fast_worst)


@pytest.mark.parametrize("kernel,stride,padding,dilation", [(5, 1, 0, 1), (3, 2, 1, 1), ((3, 5), (2, 1), (2, 0), (1, 2))])
@pytest.mark.parametrize("chunk,group_bytes", [(CHUNK_COLUMNS, 1 << 24), (16, 1 << 24), (16, 1), (3, 1 << 24)])
def test_conv_input_columns_equal_unfold(monkeypatch, kernel, stride, padding, dilation, chunk, group_bytes):
    """A convolution's input columns against ``F.unfold`` (non-square kernels, strides, padding,
    dilation) and their Gram — one chunk; many chunks in one batched GEMM; one GEMM per chunk —
    against one float64 product; the same Gram from the pixel Gram without unfolding (the samples
    in one chunk, or in chunks of 3)."""
    monkeypatch.setattr(gram_module, "CHUNK_COLUMNS", chunk)
    monkeypatch.setattr(gram_module, "GRAM_GROUP_BYTES", group_bytes)
    conv = nn.Conv2d(3, 4, kernel, stride=stride, padding=padding, dilation=dilation)
    x = torch.randn(7, 3, 13, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)  # (M, I, S)
    X = layers.input_columns(conv, x)
    assert torch.equal(X, u.transpose(0, 1).reshape(u.shape[1], -1))
    torch.testing.assert_close(gram_module.float64_gram(X), X @ X.T, rtol=1e-12, atol=1e-12)
    gram, positions = inputs._conv_input_gram(conv, x)
    assert positions == u.shape[2]
    torch.testing.assert_close(gram, X @ X.T, rtol=1e-12, atol=1e-12)
    x32 = x.float()
    X32 = X.float()
    gram, positions = inputs.input_gram(conv, x32)  # whichever path pays, float32 in, float64 sums
    assert positions == u.shape[2]
    torch.testing.assert_close(gram, X @ X.T, rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(inputs._conv_input_gram(conv, x32)[0], X32.double() @ X32.double().T, rtol=2e-6, atol=1e-5)
    lin = layers.input_columns(nn.Linear(11, 2), x)  # a linear layer: every position's inputs, a view
    assert lin.data_ptr() == x.data_ptr() and torch.equal(lin, x.reshape(-1, 11).T)


@pytest.mark.parametrize("structure", ["kron", "diag", "diag+full"])
@pytest.mark.parametrize("name,kwargs", [("lenet", {"bias": True}), ("mlp", {"hidden": 24})])
def test_fast_equals_laplace_float64(fmnist_train, name, kwargs, structure):
    _compare(ModelSpec(name, kwargs), fmnist_train, structure, torch.float64, 100, 1e-10)


@pytest.mark.parametrize("structure", ["kron", "diag", "diag+full"])
def test_fast_equals_laplace_on_a_plugin_model(fmnist_train, plugin_spec, structure):
    _compare(plugin_spec, fmnist_train, structure, torch.float32, 150, 1e-5)
    _compare(plugin_spec, fmnist_train, structure, torch.float64, 60, 1e-10)


@pytest.mark.parametrize("name,kwargs", [("lenet", {"bias": True}), ("mlp", {"hidden": 24})])
def test_last_layer_ggn_equals_dense_jacobian_reference(fmnist_train, name, kwargs):
    """Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n with J the float64 Jacobian of the logits with respect
    to the last layer's (weight, bias), flattened in parameter order."""
    from torch.func import functional_call, jacrev

    torch.manual_seed(0)
    model = ModelSpec(name, kwargs).build().double().eval()
    x, y = _data(name, fmnist_train, 80, torch.float64)
    last = model[-1]
    feats = model[:-1](x).detach()
    params = {k: v.detach() for k, v in last.named_parameters()}
    jac = jacrev(lambda p: functional_call(last, p, (feats,)))(params)
    J = torch.cat([jac[k].reshape(80, 10, -1) for k in params], 2)  # weight row-major, then bias
    p = model(x).softmax(-1).detach()
    G = torch.einsum("nci,ncd,ndj->ij", J, torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1), J)
    curv, how = capture("diag+full", model, x, y, 32, "exact", method="fast")
    assert how == "fast"
    torch.testing.assert_close(curv.blocks[-1].to_tensors()["dense"], G, rtol=1e-12, atol=1e-12 * G.abs().max().item())


def _sampled_parts(curv) -> torch.Tensor:
    """Everything that depends on the sampled labels (all but the data-only K-FAC ``A`` factors)."""
    return torch.cat([t.reshape(-1) for b in curv.blocks for k, t in b.to_tensors().items() if k != "kron_A"])


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_mc_capture_is_unbiased(fmnist_train, structure):
    """The mean of S = 300 MC captures (one sampled label each) converges to the exact GGN:
    ‖mean − exact‖² stays within 3× its expectation Σ se² (se estimated from the draws), and
    averaging really shrinks the single-draw error (by ≈ √S)."""
    torch.manual_seed(0)
    model = ModelSpec("lenet", {"bias": True}).build().double().eval()
    x, y = _data("lenet", fmnist_train, 40, torch.float64)
    exact, _ = capture(structure, model, x, y, 40, "exact")
    ref = _sampled_parts(exact)
    draws = []
    for s in range(300):
        c, how = capture(structure, model, x, y, 40, "mc", generator=torch.Generator().manual_seed(s))
        assert how == "fast"
        if structure == "kron":  # the A factors do not depend on the labels: equal to the exact ones
            for eb, cb in zip(exact.blocks, c.blocks):
                if "kron_A" in eb.to_tensors():
                    torch.testing.assert_close(cb.to_tensors()["kron_A"], eb.to_tensors()["kron_A"])
        draws.append(_sampled_parts(c))
    draws = torch.stack(draws)
    mean = draws.mean(0)
    se2 = (draws.var(0) / draws.shape[0]).sum()
    err2 = ((mean - ref) ** 2).sum()
    assert err2 <= 3 * se2, f"‖mean − exact‖² = {err2:.3e} vs Σ se² = {se2:.3e}"
    assert err2.sqrt() < 0.2 * (draws[0] - ref).norm()


def test_unsupported_models_are_refused_by_the_fast_capture_and_taken_by_laplace_on_request(fmnist_train):
    """The default capture never falls back to laplace-torch: a model it cannot take is one ConfigError line
    naming why and the option; `capture: laplace` computes it with laplace-torch when asked."""
    x, y = _data("lenet", fmnist_train, 64, torch.float32)
    grouped = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Conv2d(4, 4, 3, groups=2), nn.ReLU(), nn.Flatten(),
                            nn.Linear(4 * 24 * 24, 10)).eval()
    assert "groups" in unsupported_reason(grouped)
    with pytest.raises(ConfigError, match="groups.*`capture` laplace"):
        capture("diag", grouped, x, y, 32, method="fast")
    curv, how = capture("diag", grouped, x, y, 32, method="laplace")
    assert how == "laplace"
    assert curv.blocks[0].to_tensors()["diag"].shape == (sum(p.numel() for p in grouped.parameters()),)
    x, y = _data("mlp", fmnist_train, 64, torch.float32)

    shared = nn.Linear(784, 784)
    twice = nn.Sequential(nn.Flatten(), shared, nn.Tanh(), shared, nn.Linear(784, 10))
    assert unsupported_reason(twice) is None  # structurally fine ...
    assert "exactly once" in unsupported_reason(twice, x[:2])  # ... but a layer runs twice


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kernel,shape", [(2, (3, 4, 24, 24)), (2, (2, 3, 9, 7)), ((2, 3), (2, 2, 8, 10)), (3, (1, 2, 7, 7))])
def test_window_max_equals_max_pool2d(dtype, kernel, shape):
    """The strided-view maxima = ``F.max_pool2d``, bit for bit (odd sizes, non-square windows, ties)."""
    gen = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(shape, generator=gen, dtype=dtype)).round().relu()
    assert torch.equal(maxpool.window_max(x, *nn.modules.utils._pair(kernel)), F.max_pool2d(x, kernel))


def test_fast_max_pooling_only_where_exact_and_gradient_free_then_restored():
    model = nn.Sequential(nn.MaxPool2d(2), nn.MaxPool2d(3, stride=2), nn.MaxPool2d(2, padding=1),
                          nn.MaxPool2d(2, ceil_mode=True), nn.MaxPool2d((2, 3)))
    assert [maxpool.covered(m) for m in model] == [(2, 2), None, None, None, (2, 3)]
    x = torch.randn(1, 1, 12, 12)
    calls = []
    original = maxpool.window_max
    with maxpool.fast_max_pooling(model):
        assert "forward" in vars(model[0]) and "forward" not in vars(model[1])
        maxpool.window_max = lambda *a: calls.append(a[1:]) or original(*a)
        try:
            with torch.no_grad():
                assert torch.equal(model[0](x), F.max_pool2d(x, 2))
            assert torch.equal(model[0](x[0]), F.max_pool2d(x[0], 2))  # 3-D input: torch's own forward
            v = x.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(model[0](v).sum(), v)  # a gradient flows: torch's own pooling
            assert grad.sum() == 36
        finally:
            maxpool.window_max = original
    assert calls == [(2, 2)]
    assert all("forward" not in vars(m) for m in model)
