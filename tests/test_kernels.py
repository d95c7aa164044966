"""Kronecker kernels: Triton (interpreter on CPU, real on GPU) against the torch reference; the
kernel choice; the fedbens step replayed from a CUDA graph (on a GPU) against dense float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import fit_split, random_psd

import posterior_fusion
from posterior_fusion.curvature import Kron
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.block_stacks import stack_kron
from posterior_fusion.fusion.gaussian_stack import StackedGaussians
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings, GlobalLogPosterior, fedbens
from posterior_fusion.fusion.types import FusionInputs, FusionOptions
from posterior_fusion.kernels import choose_backend, kron_direct_forms, kron_quadratic_forms, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install posterior-fusion[gpu])")


def problem(K, N, P, Q, R1, R2, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(K, P, Q, generator=g, dtype=dtype)
    mu = torch.randn(N, P, Q, generator=g, dtype=dtype)
    UB = torch.linalg.qr(torch.randn(N, P, P, generator=g, dtype=dtype))[0][..., -R1:].contiguous()
    UA = torch.linalg.qr(torch.randn(N, Q, Q, generator=g, dtype=dtype))[0][..., -R2:].contiguous()
    S = torch.rand(N, R1, R2, generator=g, dtype=dtype) * 5 + 0.1
    gq = torch.randn(K, N, generator=g, dtype=dtype)
    return [t.to(DEVICE) for t in (W, mu, UB, UA, S, gq)]


def dense_reference(W, mu, UB, UA, S):
    """q[k, n] = vᵀ (U_B ⊗ U_A) diag(S) (U_B ⊗ U_A)ᵀ v with v = vec(W_k − mu_n), all dense float64."""
    K, N = W.shape[0], mu.shape[0]
    q = torch.empty(K, N, dtype=torch.float64)
    for n in range(N):
        U = torch.kron(UB[n].double().cpu(), UA[n].double().cpu())  # (PQ, R1R2), row-major vec
        L = U @ torch.diag(S[n].double().cpu().reshape(-1)) @ U.T
        for k in range(K):
            v = (W[k] - mu[n]).double().cpu().reshape(-1)
            q[k, n] = v @ L @ v
    return q


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 20, 37, 20, 37), (1, 4, 70, 90, 70, 90), (3, 2, 70, 90, 9, 33), (2, 5, 6, 25, 6, 25)])
def test_triton_matches_reference_values_and_gradients(dtype, shape):
    if dtype == torch.float64 and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("fp64 tl.dot needs sm80+")
    W, mu, UB, UA, S, gq = problem(*shape, dtype)
    P, Q = shape[2], shape[3]
    results = {}
    for backend in ("torch", "triton"):
        Wb = W.clone().requires_grad_(True)
        q = kron_quadratic_forms(Wb, mu, UB, UA, S, backend=backend)
        (q * gq).sum().backward()
        results[backend] = (q.detach(), Wb.grad)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-9)
    if P * Q <= 1000:  # dense (PQ x PQ) float64 reference for the small shapes
        torch.testing.assert_close(results["torch"][0].double().cpu(), dense_reference(W, mu, UB, UA, S), **tol)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], **tol)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], **tol)
    # The reference gradient itself against autograd through the dense formula.
    Wd = W.detach().double().cpu().requires_grad_(True)
    Z = UB.double().cpu().transpose(-1, -2) @ (Wd[:, None] - mu.double().cpu()[None]) @ UA.double().cpu()
    ((Z.square() * S.double().cpu()).sum((-2, -1)) * gq.double().cpu()).sum().backward()
    torch.testing.assert_close(results["torch"][1].double().cpu(), Wd.grad, **tol)


def test_kron_sample_covariance():
    """``Kron.sample`` (the one Kronecker sampler) against the inverse of the dense precision."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        k = Kron(random_psd(3, gen), random_psd(4, gen)).precision(0.5, 0.3)
        x = k.sample(200_000, generator=gen)
        cov = torch.linalg.inv(k.to_dense())
        emp = x.T @ x / x.shape[0]
        assert (emp - cov).abs().max() / cov.abs().max() < 0.03


@pytest.fixture(scope="module")
def kron_clients(tmp_path_factory, small_silo):
    return fit_split(tmp_path_factory.mktemp("kern"), small_silo, 2, 100, "kron", model="mlp",
                     kwargs={"hidden": 24, "bias": True}, mixtures=2, epochs=2)


@needs_triton
def test_fedbens_same_modes_with_reference_and_triton():
    """The fedbens server loop (Adam, clipping, selection) with either kernel gives the same modes."""
    from conftest import random_clients

    clients = random_clients("kron", C=3, M=2, seed=4)
    for c in clients:  # float32 artifacts, as read from disk
        for comp in c.components:
            object.__setattr__(comp, "map", comp.map.float())
    opts = dict(progress=False, device=DEVICE)
    settings = FedBEnsSettings(steps=20, adam_lr=0.05)
    ref = fedbens(FusionInputs(clients, FusionOptions(kernel="torch", **opts)), settings)
    tri = fedbens(FusionInputs(clients, FusionOptions(kernel="triton", **opts)), settings)
    for a, b in zip(ref.members, tri.members, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ref.members[0], clients[0].components[0].map)  # the modes moved


def test_lowrank_shortcut_bounded_error_and_smaller_ranks(kron_clients):
    clients = [posterior_fusion.load(p) for p in kron_clients]
    comps = [c for cl in clients for c in cl.components]
    exact = StackedGaussians(comps, 1 / 0.1, 10.0, torch.float64)
    W = torch.stack([c.map.double() for c in comps]) + 0.05 * torch.randn(len(comps), exact.dim, dtype=torch.float64,
                                                                         generator=torch.Generator().manual_seed(0))
    q_exact = exact.quadratic_forms(W)
    for tol in (1e-2, 1e-3):
        lr = StackedGaussians(comps, 1 / 0.1, 10.0, torch.float64, spectral_cutoff=tol)
        rel = ((lr.quadratic_forms(W) - q_exact).abs() / q_exact).max()
        assert rel <= tol
        torch.testing.assert_close(lr.logdets, exact.logdets)
        kept = sum(r[2] * r[3] for r in lr.ranks)
        assert kept < sum(r[0] * r[1] for r in lr.ranks)  # real K-FAC spectra decay: something is dropped
    objs = [GlobalLogPosterior(clients, [0.1, 0.1], [10.0, 10.0], 10.0, torch.float64, spectral_cutoff=t)(W[:3]) for t in (0.0, 0.0)]
    torch.testing.assert_close(objs[0], objs[1])


def test_unknown_backend_is_a_typed_error():
    from posterior_fusion.errors import ConfigError

    W, mu, UB, UA, S, _ = problem(1, 1, 3, 4, 3, 4, torch.float32)
    with pytest.raises(ConfigError):
        kron_quadratic_forms(W, mu, UB, UA, S, backend="cuda-magic")


def test_lowrank_does_not_depend_on_eigenvalue_order():
    """Eigenpairs given in descending order (not eigh's) must select the same directions."""
    g = torch.Generator().manual_seed(3)
    P, Q = 12, 20
    UB = torch.linalg.qr(torch.randn(P, P, generator=g, dtype=torch.float64))[0]
    UA = torch.linalg.qr(torch.randn(Q, Q, generator=g, dtype=torch.float64))[0]
    b, a = torch.logspace(2, -6, P, dtype=torch.float64), torch.logspace(0, -6, Q, dtype=torch.float64)
    comps = []
    for flip in (False, True):
        k = Kron((UB * b) @ UB.T, (UA * a) @ UA.T)
        k._eig = (b.flip(0), UB.flip(1), a.flip(0), UA.flip(1)) if flip else (b, UB, a, UA)
        from posterior_fusion.curvature import BlockDiag
        from posterior_fusion.posterior import Component

        comps.append(Component(0, torch.zeros(P * Q, dtype=torch.float64), BlockDiag([k]), {}, 0.1, 10.0))
    W = torch.randn(2, P * Q, generator=g, dtype=torch.float64)
    exact = StackedGaussians(comps[:1], 10.0, 10.0, torch.float64).quadratic_forms(W)
    for comp in comps:
        low = StackedGaussians([comp], 10.0, 10.0, torch.float64, spectral_cutoff=1e-3)
        assert ((low.quadratic_forms(W) - exact).abs() / exact).max() <= 1e-3
        assert low.ranks[0][2] < P or low.ranks[0][3] < Q


def test_chunked_kron_quadratic_forms_equal_unchunked(kron_clients):
    """Processing components in bounded chunks gives the same values and gradients."""
    clients = [posterior_fusion.load(p) for p in kron_clients]
    comps = [c for cl in clients for c in cl.components] * 3
    stack = StackedGaussians(comps, 1 / 0.1, 10.0, torch.float64)
    low = StackedGaussians(comps, 1 / 0.1, 10.0, torch.float64, spectral_cutoff=1e-30)  # the rotated form
    W = torch.stack([c.map.double() for c in comps[:4]]).requires_grad_(True)
    kron = [(b, "direct") for b in stack.blocks if hasattr(b, "rank")]
    kron += [(b, "rotated") for b in low.blocks if hasattr(b, "rank")]
    assert all(b.S is None for b, form in kron if form == "direct")  # the direct form alone is kept
    for b, form in kron:
        w = W[:, b.offset : b.offset + b.size]
        whole = b.quadratic_forms(w, chunk_bytes=1 << 40, form=form)
        tiny = b.quadratic_forms(w, chunk_bytes=1, form=form)  # one component per chunk
        torch.testing.assert_close(tiny, whole, rtol=1e-12, atol=1e-10)
        g1 = torch.autograd.grad(whole.sum(), W, retain_graph=True)[0]
        g2 = torch.autograd.grad(tiny.sum(), W)[0]
        torch.testing.assert_close(g2, g1, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-11), (torch.float32, 1e-4)])
def test_direct_form_equals_rotated_and_dense_reference(dtype, rtol, K):
    """q[k, n] = (w_k − μ_n)ᵀ (s_n B_n ⊗ A_n + λ_n I)(w_k − μ_n) from the raw factors equals the
    rotated kernel and a dense float64 matrix, values and gradients (weighted by random g)."""
    gen = torch.Generator().manual_seed(0)
    N, P, Q = 6, 7, 5
    blocks = [Kron(random_psd(P, gen, rank=3), random_psd(Q, gen)) for _ in range(N)]  # B rank-deficient
    mu = torch.randn(N, P * Q, generator=gen, dtype=torch.float64)
    scales = torch.rand(N, generator=gen, dtype=torch.float64) + 0.5
    shifts = torch.rand(N, generator=gen, dtype=torch.float64) + 0.1
    st = stack_kron(blocks, 0, mu.to(dtype), scales.to(dtype), shifts.to(dtype), dtype, rotated=True)
    W = torch.randn(K, P * Q, generator=gen, dtype=torch.float64)
    g = torch.randn(K, N, generator=gen, dtype=torch.float64)
    ref, ref_grad = torch.zeros(K, N, dtype=torch.float64), torch.zeros(K, P * Q, dtype=torch.float64)
    for n, b in enumerate(blocks):
        L = scales[n] * torch.kron(b.B, b.A) + shifts[n] * torch.eye(P * Q, dtype=torch.float64)
        V = W - mu[n]
        ref[:, n] = torch.einsum("ki,ij,kj->k", V, L, V)
        ref_grad += 2 * g[:, n : n + 1] * (V @ L)
    # the low-rank shortcut at a tolerance that drops nothing: its closed-form shift term is exact
    low = stack_kron(blocks, 0, mu.to(dtype), scales.to(dtype), shifts.to(dtype), dtype, spectral_cutoff=1e-30)
    assert low.shift is not None
    for stacked, form in ((st, "direct"), (st, "rotated"), (low, "rotated")):
        w = W.to(dtype).requires_grad_(True)
        q = stacked.quadratic_forms(w, form=form)
        (grad,) = torch.autograd.grad((q * g.to(dtype)).sum(), w)
        q2, vjp = stacked.forms_and_vjp(w.detach(), form=form, chunk_bytes=1)  # no graph; one component per chunk
        for values, gradient in ((q, grad), (q2, vjp(g.to(dtype)))):
            torch.testing.assert_close(values.double(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())
            torch.testing.assert_close(gradient.double(), ref_grad, rtol=rtol, atol=rtol * ref_grad.abs().max().item())
    if dtype == torch.float64:
        w = W.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda v: st.quadratic_forms(v, form="direct"), (w,))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 20, 37), (1, 2, 70, 90), (3, 4, 6, 25)])
def test_triton_direct_form_matches_torch_values_and_gradients(dtype, shape):
    """The fused direct-form kernel (forward, and the one-pass gradient) = the torch direct form."""
    if dtype == torch.float64 and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("fp64 tl.dot needs sm80+")
    K, N, P, Q = shape
    gen = torch.Generator().manual_seed(1)
    B = torch.stack([random_psd(P, gen) for _ in range(N)]).to(dtype)
    A = torch.stack([random_psd(Q, gen) for _ in range(N)]).to(dtype)
    mu = torch.randn(N, P, Q, generator=gen, dtype=torch.float64).to(dtype)
    W = torch.randn(K, P, Q, generator=gen, dtype=torch.float64).to(dtype)
    scale = (torch.rand(N, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    shift = (torch.rand(N, generator=gen, dtype=torch.float64) + 0.1).to(dtype)
    g = torch.randn(K, N, generator=gen, dtype=torch.float64).to(dtype)
    out = {}
    for backend in ("torch", "triton"):
        args = [t.to(DEVICE) for t in (mu, B, A, B @ mu, scale, shift)]
        w = W.to(DEVICE).clone().requires_grad_(True)
        q = kron_direct_forms(w, *args, backend=backend)
        (q * g.to(DEVICE)).sum().backward()
        out[backend] = (q.detach().cpu(), w.grad.cpu())
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(out["triton"][0], out["torch"][0], **tol)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], **tol)


def test_default_kernel_is_torch_on_every_device(monkeypatch):
    """torch is the default on a GPU too (Triton measured slower there); ``$PFUSE_KERNEL`` and an
    explicit choice override it, and an unknown name is refused."""
    monkeypatch.delenv("PFUSE_KERNEL", raising=False)
    W = torch.zeros(2, device=DEVICE)
    assert choose_backend(W) == "torch"
    monkeypatch.setenv("PFUSE_KERNEL", "cublas")
    with pytest.raises(ConfigError, match="PFUSE_KERNEL must be one of torch, triton; got 'cublas'"):
        choose_backend(W)
    assert choose_backend(W, "torch") == "torch"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")


@needs_cuda
@pytest.mark.parametrize("ragged", [False, True], ids=["M=2", "M=1,2,3"])
@pytest.mark.parametrize("chunk_bytes", [1, None], ids=["client-by-client", "default"])
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_cuda_graph_objective_vs_dense_float64(structure, chunk_bytes, ragged):
    """On CUDA the objective step is replayed from a captured graph: values and gradients equal the
    dense float64 reference for each of three different inputs in a row (each replay reads its own
    input), and equal the same objective without graphs."""
    from conftest import TINY_LAYOUT, dense_neg_log_posterior, random_clients

    clients = random_clients(structure, C=3, M=3 if ragged else 2, seed=0)
    if ragged:
        clients = [dataclasses.replace(c, components=c.components[: i + 1]) for i, c in enumerate(clients)]
    lams = [2.0, 3.0, 1.5]
    obj = GlobalLogPosterior(clients, [0.5] * 3, lams, 2.5, dtype=torch.float64, device="cuda", chunk_bytes=chunk_bytes)
    eager = GlobalLogPosterior(clients, [0.5] * 3, lams, 2.5, dtype=torch.float64, device="cuda",
                               chunk_bytes=chunk_bytes, cuda_graphs=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        W = torch.randn(4, TINY_LAYOUT.dim, generator=gen, dtype=torch.float64) * 0.5
        values, grad = obj.value_and_gradient(W.cuda())
        Wr = W.clone().requires_grad_(True)
        ref = torch.stack([dense_neg_log_posterior(clients, w, 0.5, lams, 2.5) for w in Wr])
        g_ref = torch.autograd.grad(ref.sum(), Wr)[0]
        torch.testing.assert_close(values.cpu(), ref.detach(), rtol=1e-10, atol=1e-8)
        torch.testing.assert_close(grad.cpu(), g_ref, rtol=1e-9, atol=1e-9)
        v2, g2 = eager.value_and_gradient(W.cuda())
        torch.testing.assert_close(values, v2, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, g2, rtol=1e-12, atol=1e-12)
    assert [entry is not None for entry in obj._graphed._graphs.values()] == [True]  # one shape: captured once


@needs_cuda
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_cuda_graph_objective_lowrank_and_triton_equal_eager(kernel):
    """The low-rank shortcut (rotated forms plus the closed-form shift) and the Triton kernels are
    captured too, and their replays equal their eager steps."""
    from conftest import TINY_LAYOUT, random_clients

    if kernel == "triton" and not triton_available():
        pytest.skip("triton is not installed (pip install posterior-fusion[gpu])")
    clients = random_clients("kron", C=3, M=2, seed=1)
    opts = dict(dtype=torch.float64, device="cuda", kernel=kernel, spectral_cutoff=1e-3 if kernel == "torch" else 0.0)
    obj = GlobalLogPosterior(clients, [0.5] * 3, [2.0] * 3, 2.5, **opts)
    eager = GlobalLogPosterior(clients, [0.5] * 3, [2.0] * 3, 2.5, cuda_graphs=False, **opts)
    gen = torch.Generator().manual_seed(6)
    for _ in range(2):
        W = (torch.randn(2, TINY_LAYOUT.dim, generator=gen, dtype=torch.float64) * 0.5).cuda()
        for a, b in zip(obj.value_and_gradient(W), eager.value_and_gradient(W)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert [entry is not None for entry in obj._graphed._graphs.values()] == [True]


@needs_cuda
def test_graphed_step_falls_back_when_capture_fails():
    """A step that synchronises with the host cannot be captured: a warning, then eager results."""
    from posterior_fusion.kernels.graphs import GraphedStep

    def step(x):
        scale = float(x.abs().max().item())  # host synchronisation: not capturable
        return (x * 2 / scale,)

    graphed = GraphedStep(step)
    x = torch.randn(3, 4, device="cuda")
    with pytest.warns(RuntimeWarning, match="cannot be a CUDA graph"):
        (out,) = graphed(x)
    torch.testing.assert_close(out, step(x)[0])
    y = torch.randn(3, 4, device="cuda")
    torch.testing.assert_close(graphed(y)[0], step(y)[0])  # eager from then on, no second warning


def test_graphed_step_is_eager_on_cpu():
    from posterior_fusion.kernels.graphs import GraphedStep

    calls = []
    graphed = GraphedStep(lambda x: (calls.append(1) or x + 1,))
    x = torch.arange(3.0)
    assert torch.equal(graphed(x)[0], x + 1) and calls == [1] and graphed._graphs == {}
