"""Fusion methods against independent references (dense float64, pooled data, hand values)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from click.testing import CliRunner
from conftest import fit_artifact, random_psd

import posterior_fusion
from posterior_fusion.artifact import ClientPosterior, Component, write_client_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron
from posterior_fusion.errors import IncompatibleArtifactsError, MethodNotApplicableError
from posterior_fusion.fusion import METHODS, FusionInputs, FusionOptions, fuse
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings, GlobalLogPosterior
from posterior_fusion.fusion.methods.regmean import RegMeanSettings
from posterior_fusion.fusion.mode_laplace import negative_log_posterior
from posterior_fusion.fusion.registry import get_method
from posterior_fusion.fusion.resources import READ_OVERHEAD, estimate_fuse_bytes
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import frozen_mapping

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))

TINY = ModelSpec("mlp", {"in_features": 4, "hidden": 3, "num_classes": 2, "bias": True})
TINY_LAYOUT = ParameterLayout.from_model(TINY.build())  # W1 (3,4), b1 (3,), W2 (2,3), b2 (2,)


def client(comps: list[Component], structure: str, n: int = 10, T: float = 0.5, lam: float = 2.0,
           spec: ModelSpec = TINY, layout: ParameterLayout = TINY_LAYOUT, name: str = "c") -> ClientPosterior:
    meta = {"n_data": n, "temperature": T, "prior_precision": lam, "structure": structure,
            "num_components": len(comps), "class_counts": [n] + [0] * (spec.num_classes - 1)}
    return ClientPosterior(name, name + "-sha", spec, layout, frozen_mapping(meta), tuple(comps))


def random_curvature(structure: str, gen: torch.Generator) -> BlockDiag:
    if structure == "diag":
        return BlockDiag([Diag(torch.rand(TINY_LAYOUT.dim, generator=gen, dtype=torch.float64) * 2)])
    blocks = []
    for e in TINY_LAYOUT.entries:
        if e.matrix_shape:
            out, inn = e.matrix_shape
            blocks.append(Kron(random_psd(out, gen), random_psd(inn, gen)))
        else:
            blocks.append(Dense(random_psd(e.size, gen)))
    return BlockDiag(blocks)


def random_clients(structure: str, C: int, M: int, seed: int, T: float = 0.5, lam: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in range(C):
        comps = [Component(m, torch.randn(TINY_LAYOUT.dim, generator=gen, dtype=torch.float64),
                           random_curvature(structure, gen), {}, T, lam) for m in range(M)]
        out.append(client(comps, structure, n=10 + c, T=T, lam=lam, name=f"c{c}"))
    return out


def dense_neg_log_posterior(clients, w, T, lams, lam0, centre=None):
    """Independent float64 reference built from dense matrices and torch.distributions; ``centre``:
    the mean of every prior (the global one and each client's divided-out one; default zero)."""
    d = w.shape[-1]
    mu0 = torch.zeros(d, dtype=torch.float64) if centre is None else centre.double()
    total = torch.distributions.MultivariateNormal(mu0,
                                                   precision_matrix=lam0 * torch.eye(d, dtype=torch.float64)).log_prob(w)
    for c, lam in zip(clients, lams):
        logs = []
        for comp in c.components:
            G = torch.block_diag(*[b.to_dense() for b in comp.curvature.blocks])
            P = G / T + lam * torch.eye(d, dtype=torch.float64)
            logs.append(torch.distributions.MultivariateNormal(comp.map, precision_matrix=P).log_prob(w) - math.log(len(c.components)))
        p0c = torch.distributions.MultivariateNormal(mu0, precision_matrix=lam * torch.eye(d, dtype=torch.float64))
        total = total + torch.logsumexp(torch.stack(logs), 0) - p0c.log_prob(w)
    return -total


@pytest.mark.parametrize("ragged", [False, True], ids=["M=2", "M=1,2,3"])
@pytest.mark.parametrize("chunk_bytes", [0, 1, None], ids=["all-clients-at-once", "client-by-client", "default"])
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_fedbens_objective_and_gradient_vs_dense_float64(structure, chunk_bytes, ragged):
    clients = random_clients(structure, C=3, M=3 if ragged else 2, seed=0)
    if ragged:  # clients with different numbers of components (the per-client softmax has no common shape)
        clients = [dataclasses.replace(c, components=c.components[: i + 1]) for i, c in enumerate(clients)]
    lams = [2.0, 3.0, 1.5]  # per-client priors: the general form of the prior correction
    obj = GlobalLogPosterior(clients, [0.5] * 3, lams, 2.5, dtype=torch.float64, chunk_bytes=chunk_bytes)
    assert len(obj.chunks(4, 8)) == (3 if chunk_bytes == 1 else 1)
    gen = torch.Generator().manual_seed(5)
    W = (torch.randn(4, TINY_LAYOUT.dim, generator=gen, dtype=torch.float64) * 0.5).requires_grad_(True)
    ours = obj(W)
    ref = torch.stack([dense_neg_log_posterior(clients, w, 0.5, lams, 2.5) for w in W])
    # Objectives agree up to one constant (normalisers of the global posterior are dropped nowhere here).
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-8)
    # the value the fedbens records at its modes, from the clients' blocks (no stack; what EM reports)
    torch.testing.assert_close(negative_log_posterior(clients, [0.5] * 3, lams, 2.5, W), ref.detach(), rtol=1e-10, atol=1e-8)
    g_ours = torch.autograd.grad(ours.sum(), W, retain_graph=True)[0]
    weights = torch.tensor([0.5, -2.0, 0.0, 3.0], dtype=torch.float64)  # rows are independent: a weighted sum scales them
    torch.testing.assert_close(torch.autograd.grad((weights * ours).sum(), W)[0], weights[:, None] * g_ours)
    Wr = W.detach().clone().requires_grad_(True)
    g_ref = torch.autograd.grad(torch.stack([dense_neg_log_posterior(clients, w, 0.5, lams, 2.5) for w in Wr]).sum(), Wr)[0]
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-9, atol=1e-9)


def linear_gaussian_clients(C: int = 3, p: int = 5, sigma2: float = 0.5, lam: float = 2.0, seed: int = 0):
    """Bayesian linear regression silos; returns clients (exact Gaussian posteriors) and the pooled posterior."""
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(p, generator=gen, dtype=torch.float64)
    spec = ModelSpec("mlp", {"in_features": p, "hidden": 1, "num_classes": 1, "bias": False})
    layout = ParameterLayout.from_shapes([("w", (p,))])
    clients, XtX, Xty = [], torch.zeros(p, p, dtype=torch.float64), torch.zeros(p, dtype=torch.float64)
    for c in range(C):
        n = 4 + 3 * c
        X = torch.randn(n, p, generator=gen, dtype=torch.float64) * (1 + c)
        y = X @ w_true + math.sqrt(sigma2) * torch.randn(n, generator=gen, dtype=torch.float64)
        G = X.T @ X / sigma2
        Lc = G + lam * torch.eye(p, dtype=torch.float64)
        w_c = torch.linalg.solve(Lc, X.T @ y / sigma2)
        XtX += X.T @ X
        Xty += X.T @ y
        clients.append(client([Component(0, w_c, BlockDiag([Dense(G)]), {}, 1.0, lam)], "diag+full", n=n, T=1.0,
                              lam=lam, spec=spec, layout=layout, name=f"lin{c}"))
    L = XtX / sigma2 + lam * torch.eye(p, dtype=torch.float64)
    return clients, torch.linalg.solve(L, Xty / sigma2), L


def test_product_recovers_pooled_posterior():
    clients, mu, _ = linear_gaussian_clients()
    res = product(FusionInputs(clients, FusionOptions()))
    torch.testing.assert_close(res.members[0].double(), mu, rtol=1e-5, atol=1e-5)


def test_fedbens_recovers_pooled_posterior():
    clients, mu, L = linear_gaussian_clients()
    obj = GlobalLogPosterior(clients, [1.0] * 3, [2.0] * 3, 2.0, dtype=torch.float64)
    # The global objective is exactly the pooled Gaussian up to a constant ...
    gen = torch.Generator().manual_seed(1)
    W = mu + torch.randn(6, mu.numel(), generator=gen, dtype=torch.float64)
    diff = obj(W) - 0.5 * torch.einsum("ki,ij,kj->k", W - mu, L, W - mu)
    torch.testing.assert_close(diff, diff[0].expand_as(diff), rtol=0, atol=1e-8)
    # ... and the server's Adam finds its mode.
    res = fedbens(FusionInputs(clients, FusionOptions(progress=False)), FedBEnsSettings(steps=3000, adam_lr=0.01, clip=100.0,
                                                                                              solver="adam"))
    torch.testing.assert_close(res.members[0].double(), mu, rtol=0, atol=2e-2)


def test_fedbens_one_client_one_component_stays_at_its_map():
    clients, _, _ = linear_gaussian_clients(C=1)
    res = fedbens(FusionInputs(clients, FusionOptions(progress=False)), FedBEnsSettings(steps=2000, adam_lr=0.01, clip=100.0))
    torch.testing.assert_close(res.members[0].double(), clients[0].components[0].map, rtol=0, atol=2e-2)


def hand_clients(maps, diags, ns, structure="diag"):
    layout = ParameterLayout.from_shapes([("w", (len(maps[0]),))])
    spec = ModelSpec("mlp", {"in_features": 1, "hidden": 1, "num_classes": 1, "bias": False})
    return [client([Component(0, torch.tensor(m), BlockDiag([Diag(torch.tensor(g))]), {}, 1.0, 1.0)],
                   structure, n=n, spec=spec, layout=layout, name=f"h{i}")
            for i, (m, g, n) in enumerate(zip(maps, diags, ns))]


def test_fedavg_and_fisher_merge_by_hand():
    cl = hand_clients([[0.0, 2.0, 1.0], [4.0, 6.0, 5.0]], [[1.0, 0.0, 0.0], [3.0, 1.0, 0.0]], [1, 3])
    torch.testing.assert_close(fedavg(FusionInputs(cl, FusionOptions())).members[0], torch.tensor([3.0, 5.0, 4.0]))
    # param 0: (1*0 + 3*4)/4 = 3; param 1: only client 1 has curvature -> 6; param 2: no curvature -> FedAvg 4
    res = fisher_merge(FusionInputs(cl, FusionOptions()))
    torch.testing.assert_close(res.members[0], torch.tensor([3.0, 6.0, 4.0]))
    assert res.info["fedavg_fallback_params"] == 1


def test_regmean_by_hand():
    spec = ModelSpec("mlp", {"in_features": 2, "hidden": 1, "num_classes": 1, "bias": False})
    layout = ParameterLayout.from_model(spec.build())  # W1 (1, 2), W2 (1, 1)
    A1 = torch.tensor([[2.0, 1.0], [1.0, 1.0]])
    A2 = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    W1a, W1b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    cl = []
    for i, (A, W1, w2, n) in enumerate([(A1, W1a, 2.0, 1), (A2, W1b, 4.0, 1)]):
        curv = BlockDiag([Kron(torch.eye(1), A), Kron(torch.eye(1), torch.eye(1))])
        cl.append(client([Component(0, torch.cat([W1, torch.tensor([w2])]), curv, {}, 1.0, 1.0)], "kron", n=n,
                         spec=spec, layout=layout, name=f"r{i}"))
    out = regmean(FusionInputs(cl, FusionOptions()), RegMeanSettings(protocol="kfac")).members[0]
    # (W_a A1 + W_b A2)(A1 + A2)^-1 = [2, 4] @ [[3,1],[1,4]]^-1 = [2, 4] @ [[4,-1],[-1,3]]/11 = [4/11, 10/11]
    torch.testing.assert_close(out[:2], torch.tensor([4 / 11, 10 / 11]))
    assert out[2].item() == pytest.approx(3.0)  # second weight: both A = 1 -> plain mean


def _fedlpa_dense(clients, d: float, newton: bool = True) -> torch.Tensor:
    """FedLPA from its equations with dense float64 matrices: per weight block the precision
    f_c (B_c/n_c + dI) ⊗ (A_c + dI) (row-major vec), per bias f_c (1 + d)(B_c/n_c + dI); the mean of
    the product (``newton``) or the authors' expectation approximation B̄⁻¹ Z Ā⁻¹."""
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    f = n / n.sum()
    ref = clients[0].components[0].curvature
    out = torch.zeros(TINY_LAYOUT.dim, dtype=torch.float64)
    for j, (block, off) in enumerate(zip(ref.blocks, ref.offsets)):
        maps = [c.components[0].map[off: off + block.dim].double() for c in clients]
        bl = [c.components[0].curvature.blocks[j] for c in clients]
        eye = torch.eye
        if isinstance(block, Kron):
            Bs = [b.B / nc + d * eye(b.B.shape[0], dtype=torch.float64) for b, nc in zip(bl, n)]
            As = [b.A + d * eye(b.A.shape[0], dtype=torch.float64) for b in bl]
            if newton:
                Ps = [fc * torch.kron(B, A) for fc, B, A in zip(f, Bs, As)]
                out[off: off + block.dim] = torch.linalg.solve(sum(Ps), sum(P @ w for P, w in zip(Ps, maps)))
            else:
                Z = sum(fc * B @ w.reshape(block.shape) @ A for fc, B, A, w in zip(f, Bs, As, maps))
                Bbar, Abar = sum(fc * B for fc, B in zip(f, Bs)), sum(fc * A for fc, A in zip(f, As))
                out[off: off + block.dim] = (torch.linalg.inv(Bbar) @ Z @ torch.linalg.inv(Abar)).reshape(-1)
        else:
            Ps = [fc * (1 + d) * (b.G / nc + d * eye(b.dim, dtype=torch.float64)) for b, fc, nc in zip(bl, f, n)]
            out[off: off + block.dim] = torch.linalg.solve(sum(Ps), sum(P @ w for P, w in zip(Ps, maps)))
    return out


@pytest.mark.parametrize("damping", [0.0316, 1e-4])
def test_fedlpa_equals_dense_solve_of_its_equations(damping):
    from posterior_fusion.fusion.methods.fedlpa import FedLPASettings

    cl = random_clients("kron", C=2, M=1, seed=3)  # two clients (n = 10, 11), two layers with biases
    gen = torch.Generator().manual_seed(9)  # a singular GGN factor: the damping makes the system well-posed
    first = cl[0].components[0]
    blocks = list(first.curvature.blocks)
    blocks[0] = Kron(random_psd(3, gen, rank=1), random_psd(4, gen, rank=2))
    cl[0] = dataclasses.replace(cl[0], components=(dataclasses.replace(first, curvature=BlockDiag(blocks)),))
    fedlpa = METHODS["fedlpa"]
    got = fedlpa(FusionInputs(cl, FusionOptions()), FedLPASettings(damping=damping)).members[0].double()
    torch.testing.assert_close(got, _fedlpa_dense(cl, damping).float().double(), rtol=1e-5, atol=1e-6)
    res = fedlpa(FusionInputs(cl, FusionOptions()), FedLPASettings(damping=damping, estimate="expectation"))
    torch.testing.assert_close(res.members[0].double(), _fedlpa_dense(cl, damping, newton=False).float().double(),
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(_fedlpa_dense(cl, damping), _fedlpa_dense(cl, damping, newton=False), atol=1e-3)
    one = fedlpa(FusionInputs(cl[:1], FusionOptions())).members[0]  # one client: its own MAP
    torch.testing.assert_close(one, cl[0].components[0].map.float())


def test_fedlpa_conjugate_gradients_reach_the_tolerance():
    from posterior_fusion.fusion.methods.fedlpa import solve_layer

    gen = torch.Generator().manual_seed(0)
    Bs = [random_psd(6, gen) + 0.01 * torch.eye(6, dtype=torch.float64) for _ in range(4)]
    As = [random_psd(9, gen) + 0.01 * torch.eye(9, dtype=torch.float64) for _ in range(4)]
    Ws = [torch.randn(6, 9, generator=gen, dtype=torch.float64) for _ in range(4)]
    f = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    W, it, res = solve_layer(Bs, As, Ws, f, 1e-12, 500)
    dense = sum(fc * torch.kron(B, A) for fc, B, A in zip(f, Bs, As))
    rhs = sum(fc * torch.kron(B, A) @ w.reshape(-1) for fc, B, A, w in zip(f, Bs, As, Ws))
    torch.testing.assert_close(W.reshape(-1), torch.linalg.solve(dense, rhs), rtol=1e-9, atol=1e-9)
    assert 0 < it <= 54 and res <= 1e-12  # CG on a 54-dimensional system
    _, _, res_start = solve_layer(Bs, As, Ws, f, 1e-12, 500, newton=False)
    assert res_start > 1e-3  # the expectation approximation alone is not the solution


def test_fedlpa_authors_gd_is_their_gradient_descent_and_stops_short():
    """``estimate = "authors-gd"`` against the closed form of gradient descent on a quadratic: with the
    dense float64 K = Σ_c f_c B_c ⊗ A_c = Q diag(λ) Qᵀ, the authors' step W ← W − lr·(2/numel)·K(KW − Z)
    from x₀ = vec(B̄⁻¹ Z Ā⁻¹) gives x_k = x* + Q (1 − lr·(2/numel)·λ²)^k Qᵀ (x₀ − x*). On factors of a
    trained layer's scale (per-sample B_c/n ≈ 1e-2, A_c ≈ 1) 10,000 steps leave most of the distance to
    the exact solution x* (which ``newton`` reaches); through ``fedlpa`` the weight blocks are that
    iterate and the biases the exact solve."""
    from posterior_fusion.fusion.methods.fedlpa import FedLPASettings, authors_gd, solve_layer

    gen = torch.Generator().manual_seed(1)
    out, inn, steps = 16, 33, 10_000
    Bs = [0.01 * random_psd(out, gen) + 0.0316 * torch.eye(out, dtype=torch.float64) for _ in range(3)]
    As = [random_psd(inn, gen) + 0.0316 * torch.eye(inn, dtype=torch.float64) for _ in range(3)]
    Ws = [torch.randn(out, inn, generator=gen, dtype=torch.float64) for _ in range(3)]
    f = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    W, done, residual = authors_gd(Bs, As, Ws, f, steps, 1.0)
    K = sum(fc * torch.kron(B, A) for fc, B, A in zip(f, Bs, As))
    z = sum(fc * torch.kron(B, A) @ w.reshape(-1) for fc, B, A, w in zip(f, Bs, As, Ws))
    exact = torch.linalg.solve(K, z)
    Bbar, Abar = sum(fc * B for fc, B in zip(f, Bs)), sum(fc * A for fc, A in zip(f, As))
    x0 = (torch.linalg.inv(Bbar) @ z.reshape(out, inn) @ torch.linalg.inv(Abar)).reshape(-1)
    lam, Q = torch.linalg.eigh(K)
    want = exact + Q @ ((1 - 2.0 / (out * inn) * lam ** 2) ** steps * (Q.T @ (x0 - exact)))
    torch.testing.assert_close(W.reshape(-1), want, rtol=1e-8, atol=1e-10)
    assert done == steps and residual == pytest.approx(float((K @ want - z).norm() / z.norm()), rel=1e-6)
    assert (want - exact).norm() > 0.5 * (x0 - exact).norm()  # it stops well short of the solution ...
    newton, _, newton_residual = solve_layer(Bs, As, Ws, f, 1e-12, 1000)
    torch.testing.assert_close(newton.reshape(-1), exact, rtol=1e-8, atol=1e-10)  # ... which newton reaches
    assert residual > 1e3 * max(newton_residual, 1e-12)

    cl = random_clients("kron", C=2, M=1, seed=3)  # two layers with biases
    damping = 0.0316
    got = METHODS["fedlpa"](FusionInputs(cl, FusionOptions()),
                            FedLPASettings(damping=damping, estimate="authors-gd", gd_steps=50)).members[0].double()
    newton_all = _fedlpa_dense(cl, damping)
    n = torch.tensor([float(c.n_data) for c in cl], dtype=torch.float64)
    ref = cl[0].components[0].curvature
    for j, (block, off) in enumerate(zip(ref.blocks, ref.offsets)):
        part = slice(off, off + block.dim)
        if isinstance(block, Kron):
            Bj = [c.components[0].curvature.blocks[j].B.double() / nc + damping * torch.eye(block.shape[0], dtype=torch.float64)
                  for c, nc in zip(cl, n)]
            Aj = [c.components[0].curvature.blocks[j].A.double() + damping * torch.eye(block.shape[1], dtype=torch.float64)
                  for c in cl]
            Wj = [c.components[0].map[part].double().reshape(block.shape) for c in cl]
            Kj = sum(fc * torch.kron(B, A) for fc, B, A in zip(n / n.sum(), Bj, Aj))
            zj = sum(fc * torch.kron(B, A) @ w.reshape(-1) for fc, B, A, w in zip(n / n.sum(), Bj, Aj, Wj))
            xj = (torch.linalg.inv(sum(fc * B for fc, B in zip(n / n.sum(), Bj))) @ zj.reshape(block.shape)
                  @ torch.linalg.inv(sum(fc * A for fc, A in zip(n / n.sum(), Aj)))).reshape(-1)
            for _ in range(50):
                xj = xj - 2.0 / block.dim * Kj @ (Kj @ xj - zj)
            torch.testing.assert_close(got[part], xj.float().double(), rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(got[part], newton_all[part].float().double(), rtol=1e-5, atol=1e-6)


def test_regmean_reference_protocol_by_hand(tmp_path, small_silo):
    """The FedBEns authors' RegMean: Linear weights (W Σ G)(Σ G)⁺ with G = q_c A_c, off-diagonals
    times α; convolutions and biases the plain mean; α from the grid by validation accuracy."""
    from posterior_fusion.data.silo import SiloData
    from posterior_fusion.metrics import evaluate_members

    x, y = small_silo.x, small_silo.y
    paths = []
    for c, n in enumerate((40, 80)):
        paths.append(tmp_path / f"l{c}.h5")
        fit_artifact(paths[-1], SiloData(x[c * 100 : c * 100 + n], y[c * 100 : c * 100 + n], "fmnist", 10), "kron",
                     model="lenet", kwargs={"bias": True}, mixtures=1, seed=c)
    cl = [posterior_fusion.load(p) for p in paths]
    val = SiloData(x[-80:], y[-80:], "fmnist", 10)
    res = regmean(FusionInputs(cl, FusionOptions(), val=val))
    got = res.members[0].double()
    q = torch.tensor([40.0, 80.0], dtype=torch.float64) / 120

    def by_hand(alpha):
        w = (cl[0].components[0].map.double() + cl[1].components[0].map.double()) / 2  # plain mean
        blocks = cl[0].components[0].curvature
        for j, (e, off) in enumerate(zip(blocks.blocks, blocks.offsets)):
            entry = next(en for en in cl[0].layout.entries if en.offset == off)
            if e.kind == "kron" and len(entry.shape) == 2:  # Linear weights only
                Gs = [qc * c.components[0].curvature.blocks[j].A.double() for qc, c in zip(q, cl)]
                Gs = [alpha * G + (1 - alpha) * torch.diag(torch.diagonal(G)) for G in Gs]
                Ws = [c.components[0].map[off : off + e.dim].double().reshape(e.shape) for c in cl]
                w[off : off + e.dim] = (sum(W @ G for W, G in zip(Ws, Gs)) @ torch.linalg.pinv(sum(Gs))).reshape(-1)
        return w

    cands = {a: by_hand(a) for a in (0.1, 0.9)}
    accs = {a: evaluate_members(cl[0].model_spec, [w.float()], val)["accuracy"] for a, w in cands.items()}
    chosen = 0.1 if accs[0.1] >= accs[0.9] else 0.9
    assert res.info["regmean_alpha"] == chosen and res.info["regmean_val_accuracy"] == [accs[0.1], accs[0.9]]
    torch.testing.assert_close(got, cands[chosen], rtol=1e-5, atol=1e-6)
    conv = cl[0].layout.entries[0]  # the first convolution: the plain mean, not merged
    assert len(conv.shape) == 4
    sl = slice(conv.offset, conv.offset + conv.size)
    torch.testing.assert_close(got[sl], (cl[0].components[0].map.double()[sl] + cl[1].components[0].map.double()[sl]) / 2)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, small_silo):
    folder = tmp_path_factory.mktemp("fuse")
    x, y = small_silo.x, small_silo.y
    from posterior_fusion.data.silo import SiloData, write_silo

    paths = []
    for c in range(3):
        silo = SiloData(x[c * 100 : (c + 1) * 100], y[c * 100 : (c + 1) * 100], "fmnist", 10)
        paths.append(folder / f"post_{c}.h5")
        fit_artifact(paths[-1], silo, "kron", mixtures=2, seed=c, swag=True)
    write_silo(folder / "val.h5", SiloData(x[-100:], y[-100:], "fmnist", 10))
    fit_artifact(folder / "diag_0.h5", SiloData(x[:100], y[:100], "fmnist", 10), "diag", mixtures=2)
    fit_artifact(folder / "lenet.h5", SiloData(x[:50], y[:50], "fmnist", 10), "diag", model="lenet", mixtures=1)
    fit_artifact(folder / "m3.h5", SiloData(x[:50], y[:50], "fmnist", 10), "kron", mixtures=3)
    return folder, paths


@pytest.mark.parametrize("method", ["fedbens", "fedfisher", "fedavg", "fisher-merge", "regmean", "fedlpa", "fedbe", "swag",
                                    "ensemble"])
def test_every_method_runs_and_members_are_independent(tmp_path, fitted, method):
    folder, paths = fitted
    out = tmp_path / "g.h5"
    result = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", method, "--out", str(out),
                                        "--val", str(folder / "val.h5"), "--steps", "20", "--val-every", "5"])  # deprecated spellings: warn, apply where they exist
    assert result.exit_code == 0, result.stderr
    g = posterior_fusion.load(out)
    assert g.method == method and len(g.metadata["provenance"]) == 3
    assert {p["sha256"] for p in g.metadata["provenance"]} == {posterior_fusion.load(p).sha256 for p in paths}
    models = g.models()
    if len(models) > 1:
        before = [torch.nn.utils.parameters_to_vector(m.parameters()).clone() for m in models]
        with torch.no_grad():
            next(models[0].parameters()).add_(1.0)
        for m, b in zip(models[1:], before[1:]):
            assert torch.equal(torch.nn.utils.parameters_to_vector(m.parameters()), b)
    ev = CliRunner().invoke(pfuse, ["evaluate", str(out), "--data", str(folder / "val.h5"), "--json"])
    assert ev.exit_code == 0, ev.stderr


def test_fedbens_validation_selection_and_history(fitted):
    folder, paths = fitted
    inputs, result, meta = fuse(paths, "fedbens", FusionOptions(progress=False), {"steps": 30, "val_every": 10},
                                val_path=folder / "val.h5")
    assert len(result.members) == 2
    for hist in meta["history"]:
        assert [h["step"] for h in hist] == [0, 10, 20, 30]
        assert all("val_accuracy" in h for h in hist)
    assert result.members[0].data_ptr() != result.members[1].data_ptr()


def test_refusals(tmp_path, fitted):
    folder, paths = fitted
    with pytest.raises(IncompatibleArtifactsError, match="no client"):
        fuse([], "fedavg")
    with pytest.raises(IncompatibleArtifactsError, match="lenet.h5"):
        fuse([paths[0], folder / "lenet.h5"], "fedavg")
    with pytest.raises(IncompatibleArtifactsError, match="same number of mixtures"):
        fuse([paths[0], folder / "m3.h5"], "fedbens")
    with pytest.raises(IncompatibleArtifactsError, match="given twice"):
        fuse([paths[0], paths[0]], "fedavg")
    with pytest.raises(MethodNotApplicableError, match="product"):
        fuse(paths, "product")
    with pytest.raises(MethodNotApplicableError, match="regmean"):
        fuse([folder / "diag_0.h5"], "regmean")
    with pytest.raises(MethodNotApplicableError, match="fedlpa"):
        fuse([folder / "diag_0.h5"], "fedlpa")
    with pytest.raises(MethodNotApplicableError, match="SWAG"):
        fuse([folder / "diag_0.h5"], "swag")
    r = CliRunner().invoke(pfuse, ["fuse", str(paths[0]), str(folder / "lenet.h5"), "--out", str(tmp_path / "x.h5")])
    assert r.exit_code != 0 and r.stderr.count("\n") == 1 and "lenet.h5" in r.stderr
    r = CliRunner().invoke(pfuse, ["fuse", "--method", "fedavg", "--out", str(tmp_path / "x.h5")])
    assert r.exit_code != 0 and "no client artifacts" in r.stderr
    assert not (tmp_path / "x.h5").exists()


def test_product_on_real_diag_artifact_runs(fitted):
    folder, _ = fitted
    _, res, _ = fuse([folder / "diag_0.h5"], "product")
    # One client: product of its posterior with nothing else is its own Gaussian's mean, the MAP.
    art = posterior_fusion.load(folder / "diag_0.h5")
    torch.testing.assert_close(res.members[0], art.components[0].map, rtol=1e-5, atol=1e-6)


def test_retempering_changes_fedbens_objective(fitted):
    _, paths = fitted
    clients = [posterior_fusion.load(p) for p in paths]
    W = torch.stack([c.components[0].map for c in clients]) + 0.05
    a = GlobalLogPosterior(clients, [0.1] * 3, [10.0] * 3, 10.0)(W)
    b = GlobalLogPosterior(clients, [1.0] * 3, [10.0] * 3, 10.0)(W)
    assert not torch.allclose(a, b)


def test_write_then_fuse_through_artifacts_matches_in_memory(tmp_path):
    clients = random_clients("kron", C=2, M=2, seed=3)
    paths = []
    for i, c in enumerate(clients):
        paths.append(tmp_path / f"c{i}.h5")
        comps = [Component(k.index, k.map.float(), BlockDiag([type(b)(*[t.float() for t in raw_tensors(b)]) for b in k.curvature.blocks]), {}, 0.5, 2.0)
                 for k in c.components]
        write_client_artifact(paths[-1], TINY, TINY_LAYOUT, dict(c.metadata), comps)
    _, res, _ = fuse(paths, "fedbens", FusionOptions(progress=False), {"steps": 5})
    mem = fedbens(FusionInputs(clients, FusionOptions(progress=False)), FedBEnsSettings(steps=5))
    for a, b in zip(res.members, mem.members):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def raw_tensors(block):
    if isinstance(block, Kron):
        return block.B, block.A
    if isinstance(block, Dense):
        return (block.G,)
    return (block.g,)


def test_fedbe_distillation_with_unlabeled_data(fitted):
    folder, paths = fitted
    inputs, res, meta = fuse(paths, "fedbe", FusionOptions(progress=False), {"num_samples": 4, "distill_epochs": 5, "sharpen": 1.0},
                             unlabeled_path=folder / "val.h5")
    assert len(res.members) == 1 and meta["distilled_from"] == 1 + 3 + 4
    # The student moved away from the Gaussian mean it started from, towards the teachers.
    from posterior_fusion.fusion.methods.fedbe import FedBESettings, fedbe

    no_distill = fedbe(FusionInputs(inputs.clients, FusionOptions(progress=False)), FedBESettings(num_samples=4))
    assert not torch.allclose(res.members[0], no_distill.members[0])
    from posterior_fusion.models.functional import batched_logits

    x, _ = inputs.unlabeled.tensors()
    teacher = torch.softmax(batched_logits(inputs.spec, torch.stack(no_distill.members), x), -1).mean(0)
    kl = lambda w: (teacher * (teacher.clamp_min(1e-12).log() - torch.log_softmax(batched_logits(inputs.spec, w[None], x)[0], -1))).sum(-1).mean()  # noqa: E731
    assert kl(res.members[0]) < kl(no_distill.members[0])


@pytest.mark.parametrize("starts", ["clients", "median+clients"])
def test_fedbens_starts_from_client_maps(fitted, starts):
    """More global modes than M: one Adam run per client component's MAP (and the medians)."""
    folder, paths = fitted
    clients = [posterior_fusion.load(p) for p in paths]
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    res0 = fedbens(inputs, FedBEnsSettings(steps=0, laplace=False, starts=starts))
    maps = [comp.map for c in clients for comp in c.components]
    medians = [torch.stack([c.components[m].map for c in clients]).median(0).values for m in range(2)]
    want = maps if starts == "clients" else medians + maps
    assert len(res0.members) == len(want)
    for got, w in zip(res0.members, want):
        torch.testing.assert_close(got, w)
    res = fedbens(inputs, FedBEnsSettings(steps=20, laplace=True, starts=starts, solver="adam"))
    assert len(res.members) == len(want) == len(res.curvatures)
    obj = GlobalLogPosterior(clients, [c.temperature for c in clients], [c.prior_precision for c in clients],
                             clients[0].prior_precision)
    with torch.no_grad():
        assert (obj(torch.stack(res.members)) <= obj(torch.stack(want)) + 1e-3).all()


def test_coinciding_rows_groups_by_key_within_a_relative_distance():
    """Rows are one mode when they share a key (the objective they were optimised against) and lie within the
    tolerance of the group's first row, relative to the larger norm; a row joins the first group it fits."""
    from posterior_fusion.fusion.methods.fedbens import coinciding_rows

    base = torch.tensor([[100.0, 0.0], [0.0, 100.0]], dtype=torch.float64)
    W = torch.stack([base[0], base[1], base[0] + torch.tensor([5e-4, 0.0], dtype=torch.float64),  # 5e-6 relative
                     base[0] + torch.tensor([0.0, 2e-3], dtype=torch.float64),                 # 2e-5: apart
                     base[1], base[0]])
    assert coinciding_rows(W, [0, 0, 0, 0, 0, 0], 1e-5) == [[0, 2, 5], [1, 4], [3]]
    assert coinciding_rows(W, [0, 0, 0, 0, 0, 1], 1e-5) == [[0, 2], [1, 4], [3], [5]]  # another key: another mode
    assert coinciding_rows(W, [0] * 6, 0.0) == [[0, 5], [1, 4], [2], [3]]  # exact copies still coincide at 0
    assert coinciding_rows(W, [0] * 6, 1e-4) == [[0, 2, 3, 5], [1, 4]]


def test_starts_that_end_on_one_mode_are_one_member_weighted_by_their_share(fitted, monkeypatch):
    """EM's stationary point does not depend on where it starts, only on the prior centre (the component index):
    with `starts=median+clients` and `modes=1` the 1 + 3·2 rows end on two modes, from 4 and 3 starts. Each is one
    member weighted by its starts' share (4/7, 3/7), with the row's curvature; the map and glm predictives equal
    those of the unmerged rows (MERGE_TOLERANCE = 0: every row a member, uniform weights)."""
    from posterior_fusion.data.silo import read_silo
    from posterior_fusion.fusion.methods import fedbens as fedbens_module
    from posterior_fusion.predictive import predict

    folder, paths = fitted
    clients = [posterior_fusion.load(p) for p in paths]
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    settings = FedBEnsSettings(solver="em", starts="median+clients", modes=1, prior_centre="clients",
                               server_prior="clients", steps=50)
    merged = fedbens(inputs, settings)
    plain = fedbens(inputs, dataclasses.replace(settings, laplace=False))  # without the Laplace step: the same members
    assert plain.info["members_from_starts"] == merged.info["members_from_starts"]
    torch.testing.assert_close(plain.mode_weights, merged.mode_weights)
    # Laplace weights: a mode keeps its rows' mass. Here they are one-hot (modes far apart in the objective), so the
    # check flattens them — the same softmax of the objective per mode, at the distinct modes' own spread
    values = merged.info["laplace"]["objective_at_modes"]
    spread = abs(values[0] - values[1]) or 1.0
    monkeypatch.setattr(fedbens_module, "laplace_mode_weights",
                        lambda v, precisions: torch.softmax(-(v.double() - v.double().min()) / spread, 0))
    by_mass = fedbens(inputs, dataclasses.replace(settings, mode_weights="laplace"))
    assert float(by_mass.mode_weights.min()) > 0.05
    monkeypatch.setattr(fedbens_module.merging, "MERGE_TOLERANCE", 0.0)
    rows = fedbens(inputs, settings)
    rows_by_mass = fedbens(inputs, dataclasses.replace(settings, mode_weights="laplace"))
    for k, group in enumerate(merged.info["members_from_starts"]):
        torch.testing.assert_close(by_mass.mode_weights[k], rows_by_mass.mode_weights[group].sum())
    # row 0: the median of component 0; rows 1..6: client-major, component m = (row - 1) % 2
    assert merged.info["members_from_starts"] == [[0, 1, 3, 5], [2, 4, 6]]
    assert len(rows.members) == 7 and "members_from_starts" not in rows.info
    torch.testing.assert_close(merged.mode_weights, torch.tensor([4 / 7, 3 / 7], dtype=torch.float64))
    for member, group in zip(merged.members, merged.info["members_from_starts"]):
        for r in group:
            torch.testing.assert_close(member, rows.members[r], rtol=1e-5, atol=1e-6)
    lam = merged.info["laplace"]["prior_precision"]
    x, _ = read_silo(folder / "val.h5").tensors()
    for predictive in ("map", "glm"):
        got = predict(inputs.spec, merged.members, x, predictive, [c.precision(1.0, lam) for c in merged.curvatures],
                      merged.mode_weights)
        want = predict(inputs.spec, rows.members, x, predictive, [c.precision(1.0, lam) for c in rows.curvatures],
                       rows.mode_weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fuse_says_when_starts_merged_and_the_artifact_keeps_their_weights(fitted, tmp_path):
    """`pfuse fuse` says how many starts reached how many modes, labels the history by start, and the global
    artifact carries the members' weights and their starts (read back through the artifact's validation)."""
    folder, paths = fitted
    out = tmp_path / "g.h5"
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedbens", "--out", str(out),
                                   "--set", "solver=em", "--set", "starts=median+clients", "--set", "modes=1",
                                   "--set", "server_prior=clients", "--set", "laplace=false"])
    assert r.exit_code == 0, r.output
    assert "7 starts reached 2 distinct modes" in r.output and "start 6: best step" in r.output
    g = posterior_fusion.load(out)
    assert len(g.members) == 2 and g.metadata["members_from_starts"] == [[0, 1, 3, 5], [2, 4, 6]]
    torch.testing.assert_close(g.mode_weights, torch.tensor([4 / 7, 3 / 7], dtype=torch.float64))
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedbens", "--out", str(tmp_path / "j.h5"),
                                   "--set", "solver=em", "--set", "starts=median+clients", "--set", "modes=1",
                                   "--set", "server_prior=clients", "--set", "laplace=false", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["members"] == 2 and got["members_from_starts"] == [[0, 1, 3, 5], [2, 4, 6]]


def test_fuse_memory_estimate_follows_the_fedbens_chunks():
    """fedbens' optimiser memory is one chunk of clients (flat in C) for the median starts, and grows
    with the C·M modes of client starts; a one-mode optimiser keeps every component."""
    def estimate(C, method="fedbens", **kw):
        headers = [{"num_params": 44_190, "num_components": 5, "data_bytes": 0}] * C
        return estimate_fuse_bytes(headers, method, get_method(method).settings(**kw))

    d = 44_190
    assert estimate(40) == estimate(5)  # K = 5 modes: one 64 MiB chunk of clients either way
    # C·M = 200 modes: a component's working set (3·200·d floats, 106 MB) exceeds a chunk, so one client is
    assert estimate(40, starts="clients") == READ_OVERHEAD + 5 * 3 * 200 * d * 4 + 6 * 200 * d * 4 + 2 * 200 * d * 4
    assert estimate(40, "fedfisher") - estimate(5, "fedfisher") == 4 * 175 * d * 4
    # the exact solve keeps float64 vectors of d, whatever C·M: flat in C, far under Adam's
    assert estimate(40, "fedfisher", solver="exact") == estimate(5, "fedfisher", solver="exact")
    assert estimate(40, "hbfl", solver="exact") - estimate(40, "hbfl") == 8 * d * 8 - 4 * 200 * d * 4


def test_fuse_on_the_gpu_is_refused_when_its_working_set_exceeds_the_free_gpu_memory(fitted, monkeypatch):
    """`device` cuda checks the GPU's own working set (stacked curvature, the method's work, members)
    against the memory free on the GPU before anything is loaded; one line naming the GPU."""
    from posterior_fusion.artifact.reader import declared_bytes
    from posterior_fusion.errors import ResourceLimitError
    from posterior_fusion.fusion.resources import estimate_device_bytes

    folder, paths = fitted
    headers = [declared_bytes(p) for p in paths]
    settings = get_method("fedbens").settings()
    need = estimate_device_bytes(headers, "fedbens", settings)
    d, K = headers[0]["num_params"], headers[0]["num_components"]
    assert need == 2 * sum(h["data_bytes"] for h in headers) + get_method("fedbens").work_bytes(
        settings, posterior_fusion.fusion.method_type.FuseSize(d, len(headers), K)) + K * d * 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (need, 80 * 2**30))  # 90 % of it is too little
    loaded = []
    monkeypatch.setattr(posterior_fusion.fusion.from_files, "load_client", lambda *a, **k: loaded.append(a))
    with pytest.raises(ResourceLimitError, match="of GPU memory, over 90% of the .* free on the GPU"):
        fuse(paths, "fedbens", FusionOptions(device="cuda", progress=False))
    assert not loaded  # refused before any artifact is loaded


def diag_full_random_clients(C: int, M: int, seed: int):
    """Random diag+full clients on TINY: a diagonal block over W1, b1 and a dense block over W2, b2."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in range(C):
        comps = [Component(m, torch.randn(TINY_LAYOUT.dim, generator=gen, dtype=torch.float64),
                           BlockDiag([Diag(torch.rand(15, generator=gen, dtype=torch.float64)),
                                      Dense(random_psd(TINY_LAYOUT.dim - 15, gen))]), {}, 0.5, 2.0)
                 for m in range(M)]
        out.append(client(comps, "diag+full", n=10 + c, name=f"c{c}"))
    return out


def _clients(structure: str, C: int, M: int, seed: int):
    return diag_full_random_clients(C, M, seed) if structure == "diag+full" else random_clients(structure, C, M, seed)


@pytest.mark.parametrize("structure", ["kron", "diag", "diag+full"])
def test_em_modes_are_the_dense_minimiser_and_stationary(structure):
    """fedbens `solver=em`: with one component per client the objective is a quadratic and one EM step
    is its dense float64 minimiser (Σ_c Λ_c − (Σ λ_c − λ0) I)⁻¹ Σ_c Λ_c ŵ_c; with mixtures the EM
    modes are stationary points of the dense objective (autograd gradient ≈ 0) reached with the
    objective non-increasing at every iteration."""
    from posterior_fusion.fusion.em import MixtureProduct, em_modes

    T, lams, lam0 = 0.5, [2.0, 2.0, 2.0], 2.0
    one = _clients(structure, C=3, M=1, seed=5)
    prod = MixtureProduct(one, [T] * 3, lams, lam0)
    start = one[0].components[0].map.float()[None]
    modes, hist = em_modes(prod, start, iterations=5, show_progress=False)
    d = TINY_LAYOUT.dim
    Ls = [torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks]) / T + 2.0 * torch.eye(d, dtype=torch.float64)
          for c in one]
    H = sum(Ls) - (sum(lams) - lam0) * torch.eye(d, dtype=torch.float64)
    ref = torch.linalg.solve(H, sum(L @ c.components[0].map for L, c in zip(Ls, one)))
    torch.testing.assert_close(modes[0].double(), ref, rtol=1e-5, atol=1e-5)
    assert len(hist[0]) <= 3  # one solve, then a step that does not move
    mix = _clients(structure, C=3, M=2, seed=6)
    # second components near the first (MAP and curvature): responsibilities are soft (π, log-determinants
    # and quadratic forms all count)
    mix = [dataclasses.replace(c, components=(c.components[0], dataclasses.replace(
        c.components[1], map=c.components[0].map + 0.05 * c.components[1].map,
        curvature=c.components[0].curvature.damped(1.0, 0.02)))) for c in mix]
    prod = MixtureProduct(mix, [T] * 3, lams, lam0)
    rs, _ = prod.responsibilities(torch.stack([c.components[0].map for c in mix]).median(0).values)
    assert any(0.05 < float(r[0]) < 0.95 for r in rs)
    starts = torch.stack([torch.stack([c.components[m].map for c in mix]).median(0).values for m in range(2)]).float()
    modes, hist = em_modes(prod, starts, iterations=200, tolerance=1e-10, show_progress=False)
    for k in range(2):
        values = [h["objective"] for h in hist[k]]
        assert all(b <= a + 1e-9 * abs(a) for a, b in zip(values, values[1:]))  # EM never goes up
        w = modes[k].double().requires_grad_(True)
        dense_neg_log_posterior(mix, w, T, lams, lam0).backward()
        w0 = starts[k].double().requires_grad_(True)
        dense_neg_log_posterior(mix, w0, T, lams, lam0).backward()
        assert w.grad.norm() <= 1e-5 * w0.grad.norm()


def test_damping_is_tikhonov_on_the_factors_and_bounds_the_modes():
    """fedbens `damping=d` fuses the curvature (B + n·d·I) ⊗ (A + d·I) (n: the client's samples): its EM
    mode equals the dense minimiser with those blocks; d → 0 gives the undamped mode and a large d
    the n-weighted mean of the client MAPs (FedAvg: the damped Gaussians are all but isotropic)."""
    from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings

    fedbens_ = METHODS["fedbens"]
    cl = random_clients("kron", C=3, M=1, seed=8)
    run = lambda d: fedbens_(FusionInputs(cl, FusionOptions(progress=False)),  # noqa: E731
                             FedBEnsSettings(solver="em", damping=d, laplace=False)).members[0].double()
    d_, dim = 0.7, TINY_LAYOUT.dim
    Ls = []
    for c in cl:
        blocks = []
        for b in c.components[0].curvature.blocks:
            if isinstance(b, Kron):
                blocks.append(torch.kron(b.B + c.n_data * d_ * torch.eye(b.B.shape[0], dtype=torch.float64),
                                         b.A + d_ * torch.eye(b.A.shape[0], dtype=torch.float64)))
            else:
                blocks.append(b.to_dense() + c.n_data * d_ * torch.eye(b.dim, dtype=torch.float64))
        Ls.append(torch.block_diag(*blocks) / c.temperature + c.prior_precision * torch.eye(dim, dtype=torch.float64))
    H = sum(Ls) - 2 * cl[0].prior_precision * torch.eye(dim, dtype=torch.float64)
    ref = torch.linalg.solve(H, sum(L @ c.components[0].map for L, c in zip(Ls, cl)))
    torch.testing.assert_close(run(d_), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(1e-9), run(0.0), rtol=1e-4, atol=1e-4)
    n = torch.tensor([float(c.n_data) for c in cl], dtype=torch.float64)
    fedavg_ = (n[:, None] * torch.stack([c.components[0].map for c in cl])).sum(0) / n.sum()
    torch.testing.assert_close(run(1e5), fedavg_, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("structure", ["kron", "diag", "diag+full"])
def test_trust_region_stays_in_its_region_and_is_plain_em_inside(structure):
    """fedbens `solver=em, trust_radius=ρ`: with a weak server prior the over-counted client priors
    send the unconstrained minimiser far beyond every client MAP. With ρ below its distance, the mode
    lies on the region's boundary ½(w−s)ᵀΛ̄(w−s)/N = ρ (Λ̄ = Σ_c Λ_c, dense float64) and satisfies the
    trust-region optimality condition H w − b = −ν Λ̄ (w − s) with ν ≥ 0; with ρ above it, the mode
    is plain EM's. With mixtures every iterate stays inside and the objective never rises."""
    from posterior_fusion.fusion.em import MixtureProduct, em_modes

    T, lams, lam0 = 50.0, [2.0, 2.0, 2.0], 0.02  # flat likelihoods: the over-counted priors dominate
    one = _clients(structure, C=3, M=1, seed=11)
    prod = MixtureProduct(one, [T] * 3, lams, lam0)
    d = TINY_LAYOUT.dim
    Ls = [torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks]) / T + 2.0 * torch.eye(d, dtype=torch.float64)
          for c in one]
    H = sum(Ls) - (sum(lams) - lam0) * torch.eye(d, dtype=torch.float64)
    b = sum(L @ c.components[0].map for L, c in zip(Ls, one))
    free = torch.linalg.solve(H, b)
    assert free.norm() > 3 * max(float(c.components[0].map.norm()) for c in one)  # far from every MAP
    s = torch.stack([c.components[0].map for c in one]).median(0).values
    Lbar, N = sum(Ls), float(sum(c.n_data for c in one))
    dist = lambda w: float(0.5 * (w - s) @ Lbar @ (w - s) / N)  # noqa: E731
    rho = 0.2 * dist(free)
    modes, hist = em_modes(prod, s.float()[None], iterations=50, tolerance=1e-9, show_progress=False, trust_radius=rho)
    w = modes[0].double()
    assert rho * (1 - 5e-3) <= dist(w) <= rho * (1 + 1e-5)
    g, v = H @ w - b, Lbar @ (w - s)
    nu = float(-(g @ v) / (v @ v))
    assert nu > 0 and float((g + nu * v).norm()) <= 2e-3 * float(g.norm())
    assert all(h.get("distance", 0.0) <= rho * (1 + 1e-5) for h in hist[0])
    inside, _ = em_modes(prod, s.float()[None], iterations=50, tolerance=1e-9, show_progress=False,
                         trust_radius=1.5 * dist(free))
    plain, _ = em_modes(prod, s.float()[None], iterations=50, tolerance=1e-9, show_progress=False)
    torch.testing.assert_close(inside, plain)
    torch.testing.assert_close(plain[0].double(), free, rtol=1e-4, atol=1e-4)

    mix = _clients(structure, C=3, M=2, seed=12)
    prod = MixtureProduct(mix, [T] * 3, lams, lam0)
    starts = torch.stack([torch.stack([c.components[m].map for c in mix]).median(0).values for m in range(2)]).float()
    _, free_hist = em_modes(prod, starts, iterations=100, tolerance=1e-9, show_progress=False)
    _, hist = em_modes(prod, starts, iterations=100, tolerance=1e-9, show_progress=False, trust_radius=0.5)
    for k in range(2):
        values = [h["objective"] for h in hist[k]]
        assert all(b_ <= a + 1e-9 * abs(a) for a, b_ in zip(values, values[1:]))
        assert all(h["distance"] <= 0.5 * (1 + 1e-5) for h in hist[k][1:])
    with pytest.raises(posterior_fusion.errors.ConfigError, match="trust_radius needs solver=em"):
        FedBEnsSettings(trust_radius=1.0, solver="adam").validate()


@pytest.mark.parametrize("structure", ["kron", "diag", "diag+full"])
def test_prior_centre_clients_objective_and_em_vs_dense_float64(structure):
    """fedbens `prior_centre=clients`: the objective and its gradient equal the dense float64 posterior
    whose priors (global and divided-out) are centred at each row's centre; with one component per
    client the EM mode is the dense minimiser (Σ Λ_c − e I)⁻¹ (Σ Λ_c ŵ_c − e μ), e = Σ λ_c − λ0."""
    from posterior_fusion.fusion.em import MixtureProduct, em_modes

    T, lams, lam0 = 0.5, [2.0, 3.0, 1.5], 2.5
    mix = _clients(structure, C=3, M=2, seed=11)
    gen = torch.Generator().manual_seed(2)
    centres = torch.randn(2, TINY_LAYOUT.dim, generator=gen, dtype=torch.float64)
    W = (centres + 0.3 * torch.randn(2, TINY_LAYOUT.dim, generator=gen, dtype=torch.float64)).requires_grad_(True)
    obj = GlobalLogPosterior(mix, [T] * 3, lams, lam0, dtype=torch.float64, prior_centres=centres)
    ours = obj(W)
    g_ours = torch.autograd.grad(ours.sum(), W)[0]
    Wr = W.detach().clone().requires_grad_(True)
    ref = torch.stack([dense_neg_log_posterior(mix, w, T, lams, lam0, centre=mu) for w, mu in zip(Wr, centres)])
    g_ref = torch.autograd.grad(ref.sum(), Wr)[0]
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-10, atol=1e-8)
    torch.testing.assert_close(negative_log_posterior(mix, [T] * 3, lams, lam0, W, centres), ref.detach(),
                               rtol=1e-10, atol=1e-8)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-8, atol=1e-8)
    with pytest.raises(ValueError, match="prior centres"):
        obj(W.detach()[:1])

    one = [dataclasses.replace(c, components=c.components[:1]) for c in mix]
    mu = centres[0]
    modes, _ = em_modes(MixtureProduct(one, [T] * 3, lams, lam0), one[0].components[0].map.float()[None], 5,
                        show_progress=False, prior_centres=mu.float()[None])
    d = TINY_LAYOUT.dim
    eye = torch.eye(d, dtype=torch.float64)
    Ls = [torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks]) / T + lam * eye
          for c, lam in zip(one, lams)]
    e = sum(lams) - lam0
    ref_mode = torch.linalg.solve(sum(Ls) - e * eye, sum(L @ c.components[0].map for L, c in zip(Ls, one)) - e * mu)
    torch.testing.assert_close(modes[0].double(), ref_mode, rtol=1e-5, atol=1e-5)
    inside, _ = em_modes(MixtureProduct(one, [T] * 3, lams, lam0), one[0].components[0].map.float()[None], 5,
                         show_progress=False, prior_centres=mu.float()[None], trust_radius=1e6)
    torch.testing.assert_close(inside[0].double(), ref_mode, rtol=1e-5, atol=1e-5)  # a region it never leaves
    # on the region's boundary: H w − b' = −ν Λ̄ (w − s), ν ≥ 0, with b' = Σ Λ_c ŵ_c − e μ
    s = one[0].components[0].map
    Lbar, N = sum(Ls), float(sum(c.n_data for c in one))
    dist = lambda w: float(0.5 * (w - s) @ Lbar @ (w - s) / N)  # noqa: E731
    rho = 0.2 * dist(ref_mode)
    edge, _ = em_modes(MixtureProduct(one, [T] * 3, lams, lam0), s.float()[None], 50, tolerance=1e-9,
                       show_progress=False, prior_centres=mu.float()[None], trust_radius=rho)
    w = edge[0].double()
    assert rho * (1 - 5e-3) <= dist(w) <= rho * (1 + 1e-5)
    g = (sum(Ls) - e * eye) @ w - (sum(L @ c.components[0].map for L, c in zip(Ls, one)) - e * mu)
    v = Lbar @ (w - s)
    nu = float(-(g @ v) / (v @ v))
    assert nu > 0 and float((g + nu * v).norm()) <= 2e-3 * float(g.norm())


@pytest.mark.parametrize("solver", ["em", "adam"])
def test_prior_centre_clients_keeps_the_clients_average_where_no_curvature_is(solver):
    """Diagonal clients whose curvature is zero on the first six coordinates: with the paper's zero
    centre fedbens' mode there is Σ_c λ_c ŵ_c / λ0 (≈ C times the clients' weights); with
    `prior_centre=clients` it is the clients' λ-weighted average; where the curvature is large both
    agree with the curvature-weighted mean to O(λ / G)."""
    gen = torch.Generator().manual_seed(3)
    d, lams = TINY_LAYOUT.dim, [2.0, 2.0, 2.0]
    g = torch.full((d,), 1e4, dtype=torch.float64)
    g[:6] = 0.0
    one = [client([Component(0, 1.0 + 0.2 * torch.randn(d, generator=gen, dtype=torch.float64), BlockDiag([Diag(g)]), {},
                             0.5, lam)], "diag", lam=lam, name=f"c{i}") for i, lam in enumerate(lams)]
    maps = torch.stack([c.components[0].map for c in one])
    inputs = FusionInputs(one, FusionOptions(progress=False))
    opts = dict(solver=solver, laplace=False, steps=100 if solver == "em" else 4000, adam_lr=0.01, clip=100.0)
    zero = fedbens(inputs, FedBEnsSettings(**opts)).members[0].double()
    centred = fedbens(inputs, FedBEnsSettings(**opts, prior_centre="clients")).members[0].double()
    torch.testing.assert_close(zero[:6], maps[:, :6].sum(0), rtol=1e-3, atol=1e-3)  # C · the average
    torch.testing.assert_close(centred[:6], maps[:, :6].mean(0), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(centred[6:], maps[:, 6:].mean(0), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(zero[6:], maps[:, 6:].mean(0), rtol=1e-3, atol=1e-3)
    with pytest.raises(posterior_fusion.errors.ConfigError, match="prior_centre"):
        FedBEnsSettings(prior_centre="median").validate()


def test_prior_centre_follows_each_start_component():
    """`starts=clients` with M = 2 and unequal λ_c: in the flat coordinates each of the C·M modes is the
    λ-weighted client average of the component index it starts from (rows client-major)."""
    gen = torch.Generator().manual_seed(4)
    d, lams = TINY_LAYOUT.dim, [1.0, 2.0, 4.0]
    g = torch.full((d,), 1e4, dtype=torch.float64)
    g[:6] = 0.0
    cl = [client([Component(m, 3.0 * m + torch.randn(d, generator=gen, dtype=torch.float64), BlockDiag([Diag(g)]), {},
                            0.5, lam) for m in range(2)], "diag", lam=lam, name=f"c{i}") for i, lam in enumerate(lams)]
    res = fedbens(FusionInputs(cl, FusionOptions(progress=False)),
                  FedBEnsSettings(solver="em", laplace=False, steps=100, starts="clients", prior_centre="clients"))
    lam = torch.tensor(lams, dtype=torch.float64)
    for row, w in enumerate(res.members):
        m = row % 2
        want = (lam[:, None] * torch.stack([c.components[m].map[:6] for c in cl])).sum(0) / lam.sum()
        torch.testing.assert_close(w[:6].double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("structure", ["kron", "diag+full"])
def test_component_densities_of_float32_clients_decompose_each_block_once(structure, monkeypatch):
    """EM's responsibilities, the objective at the modes and the Laplace step evaluate every client component
    at every iteration: on float32 artifacts (what a silo writes) the log-determinants come in float64 from
    the client blocks' own cached eigenvalues — one decomposition per factor over all calls, not one per call
    on a float64 copy (at width 64 that was minutes per EM mode) — and equal the float64 clients' densities."""
    from posterior_fusion.fusion.mode_laplace import component_log_densities

    clients = _clients(structure, C=2, M=2, seed=3)
    as32 = [dataclasses.replace(c, components=tuple(dataclasses.replace(comp, map=comp.map.float(),
                                                                        curvature=comp.curvature.astype(torch.float32))
                                                    for comp in c.components)) for c in clients]
    W = torch.randn(3, TINY_LAYOUT.dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = component_log_densities(clients, [0.5, 0.5], [2.0, 2.0], W)
    calls = {"n": 0}
    for name in ("eigvalsh", "eigh"):
        real = getattr(torch.linalg, name)

        def counted(*a, _real=real, **k):
            calls["n"] += 1
            return _real(*a, **k)
        monkeypatch.setattr(torch.linalg, name, counted)
    first = component_log_densities(as32, [0.5, 0.5], [2.0, 2.0], W)
    after_first = calls["n"]
    again = component_log_densities(as32, [0.5, 0.5], [2.0, 2.0], W)
    assert after_first > 0 and calls["n"] == after_first  # the second call decomposes nothing
    for a, b, r in zip(first, again, ref):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-3)  # float32 factors, float64 arithmetic


def _dense_log_evidence(one, T: float, lam_blocks: list[float], centre: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Exact ``log Z`` (up to a constant) of the server's model when each client is one Gaussian, and the
    posterior mode: ``Z = ∫ Π_c (q_c / p0_c)(w) N(w; μ, Λ0⁻¹) dw`` with ``p0_c = N(μ, λ_c⁻¹ I)`` and
    ``Λ0 = blockdiag(λ0_j I)``, from dense float64 matrices (the integrand is Gaussian:
    ``−½ Q_min − ½ log|H + Λ0| + ½ log|Λ0|``)."""
    d = TINY_LAYOUT.dim
    eye = torch.eye(d, dtype=torch.float64)
    lams = [c.prior_precision for c in one]
    Ls = [torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks]) / T + lam * eye
          for c, lam in zip(one, lams)]
    maps = [c.components[0].map for c in one]
    L0 = torch.cat([torch.full((b.dim,), v, dtype=torch.float64)
                    for b, v in zip(one[0].components[0].curvature.blocks, lam_blocks)])
    E = sum(lams) * eye - torch.diag(L0)  # the over-counted prior, per coordinate
    H = sum(Ls) - E
    w = torch.linalg.solve(H, sum(L @ m for L, m in zip(Ls, maps)) - E @ centre)
    Q = sum((w - m) @ L @ (w - m) for L, m in zip(Ls, maps)) - (w - centre) @ E @ (w - centre)
    return float(-0.5 * Q - 0.5 * torch.linalg.slogdet(H)[1] + 0.5 * torch.log(L0).sum()), w


@pytest.mark.parametrize("centre", ["prior", "clients", "base"])
@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_server_prior_evidence_maximises_the_exact_evidence_of_a_gaussian_product(structure, centre):
    """fedbens `server_prior=evidence` with one component per client: the product is Gaussian, so its
    Laplace evidence is the exact marginal likelihood of the server's prior, here one precision per block
    ``ρ c_j`` with ``c_j`` the block's mean diagonal of ``Σ_c G_c / T`` (from the dense matrices); the ρ
    found is the maximiser of the dense float64 log Z (golden section over log ρ, independent of the
    library's MacKay rounds), the mode is the dense minimiser there, and the search is recorded. (diag:
    one block; diag+full: a diagonal and a dense block. The temperature makes the clients' curvature large
    against their disagreement, for an interior maximum; otherwise the evidence prefers every client at
    the centre.)"""
    T = 0.02
    one = _clients(structure, C=3, M=1, seed=5)
    d = TINY_LAYOUT.dim
    mu = (torch.zeros(d, dtype=torch.float64) if centre == "prior"
          else torch.stack([c.components[0].map for c in one]).mean(0))  # equal λ_c: the plain average
    if centre == "base":  # clients fine-tuned from a base: every prior N(base, ·), divided out there
        mu = mu + 0.5 * torch.randn(d, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        one, centre = [dataclasses.replace(c, prior_mean=mu) for c in one], "prior"
    G = sum(torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks]) / T for c in one)
    offs = one[0].components[0].curvature.offsets
    c = [float(torch.diagonal(G)[o: o + b.dim].mean()) for o, b in zip(offs, one[0].components[0].curvature.blocks)]
    lo, hi, g = math.log(1e-8), math.log(1e4), (math.sqrt(5) - 1) / 2
    f = lambda t: _dense_log_evidence(one, T, [math.exp(t) * cj for cj in c], mu)[0]  # noqa: E731
    grid = [lo + i * (hi - lo) / 400 for i in range(401)]
    best = max(range(401), key=lambda i: f(grid[i]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, 400)]
    while hi - lo > 1e-9:
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (a, hi) if f(a) < f(b) else (lo, b)
    rho_ref = math.exp(0.5 * (lo + hi))
    assert 1e-7 < rho_ref < 1e3  # an interior maximum: the test can tell a wrong ρ from a right one
    res = fedbens(FusionInputs(one, FusionOptions(temperature=T, progress=False)),
                  FedBEnsSettings(solver="em", prior_centre=centre, server_prior="evidence", steps=20))
    lam = res.info["laplace"]["server_prior_precision"]
    search = res.info["server_prior_search"]
    f64 = dict(dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(search["block_scales"], **f64), torch.tensor(c, **f64), rtol=1e-10, atol=0)
    rho = lam[0] / c[0]
    assert abs(math.log(rho / rho_ref)) < 0.03, (rho, rho_ref)
    torch.testing.assert_close(torch.tensor(lam, **f64), rho * torch.tensor(c, **f64), rtol=1e-12, atol=0)
    assert res.info["laplace"]["server_prior"] == "evidence" and res.info["laplace"]["prior_precision"] == lam
    assert search["converged"] and len(search["rounds"]) >= 2  # MacKay rounds, from the clients' λ0
    torch.testing.assert_close(res.members[0].double(), _dense_log_evidence(one, T, lam, mu)[1], rtol=1e-5, atol=1e-5)
    assert f(math.log(rho)) > max(f(math.log(rho) + 0.3), f(math.log(rho) - 0.3))
    # the objective recorded at the mode: −log of the dense posterior with the per-block prior N(μ, Λ0⁻¹)
    w = res.members[0].double()
    L0 = torch.cat([torch.full((b.dim,), v, dtype=torch.float64) for b, v in zip(one[0].components[0].curvature.blocks, lam)])
    MVN = torch.distributions.MultivariateNormal
    eye = torch.eye(d, dtype=torch.float64)
    logp = MVN(mu, precision_matrix=torch.diag(L0)).log_prob(w)
    for c in one:
        G = torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks])
        logp = logp + MVN(c.components[0].map, precision_matrix=G / T + c.prior_precision * eye).log_prob(w)
        logp = logp - MVN(mu, precision_matrix=c.prior_precision * eye).log_prob(w)
    assert res.info["laplace"]["objective_at_modes"][0] == pytest.approx(float(-logp), rel=1e-8, abs=1e-6)


def test_server_prior_evidence_without_an_interior_maximum_stops_at_the_range_and_says_so():
    """Clients whose MAPs agree within their posterior widths (T = 50 here: wide posteriors): the evidence grows
    without bound as the modes approach the prior centre; ρ stops at the end of its search range (and never
    lets a λ0_j leave the artifacts' prior-precision range, so the global artifact stays readable), a
    warning says so, the record says `at_bound`, and the mode is the clients' average."""
    one = _clients("diag+full", C=3, M=1, seed=5)
    with pytest.warns(UserWarning, match="upper bound"):
        res = fedbens(FusionInputs(one, FusionOptions(temperature=50.0, progress=False)),
                      FedBEnsSettings(solver="em", prior_centre="clients", server_prior="evidence", steps=20))
    lam = res.info["laplace"]["server_prior_precision"]
    assert max(lam) <= 1e8 and res.info["server_prior_search"]["at_bound"]
    mean = torch.stack([c.components[0].map for c in one]).mean(0)
    torch.testing.assert_close(res.members[0].double(), mean, rtol=1e-5, atol=1e-5)


def test_server_prior_evidence_says_when_the_clients_agree_and_stops_climbing():
    """Three clients with the same MAPs and curvature agree exactly: the evidence has no interior maximum
    (ρ rises by a steady factor every round). The search stops climbing after a few rounds, solves at the
    upper bound, records `no_interior_maximum` and says in one warning that the clients agree and the mode is
    their average; the mode is that average (the clients' common MAP)."""
    from posterior_fusion.fusion.methods.fedbens.evidence import CLIMB_ROUNDS

    one = _clients("diag+full", C=1, M=1, seed=5)[0]
    same = [one, one, one]
    with pytest.warns(UserWarning) as caught:
        res = fedbens(FusionInputs(same, FusionOptions(temperature=0.1, progress=False)),
                      FedBEnsSettings(solver="em", prior_centre="clients", server_prior="evidence", steps=20))
    text = " ".join(str(w.message) for w in caught)
    assert "no interior maximum" in text and "clients agree" in text and "average" in text
    search = res.info["server_prior_search"]
    assert search["no_interior_maximum"] and search["at_bound"] and search["converged"]
    assert len(search["rounds"]) <= CLIMB_ROUNDS + 2
    torch.testing.assert_close(res.members[0].double(), one.components[0].map.double(), rtol=1e-5, atol=1e-5)


def test_server_prior_evidence_out_of_rounds_keeps_modes_and_prior_that_belong_together(monkeypatch):
    """Stopped by the round limit before ρ settles: a warning says so, and the λ0_j returned are the ones the
    returned modes were solved at (the dense minimiser there), not the next round's."""
    from posterior_fusion.fusion.methods import fedbens as fedbens_module

    monkeypatch.setattr(fedbens_module.evidence, "EVIDENCE_ROUNDS", 2)
    T = 0.02
    one = _clients("diag+full", C=3, M=1, seed=5)
    mu = torch.stack([c.components[0].map for c in one]).mean(0)
    with pytest.warns(UserWarning, match="still moved after 2 rounds"):
        res = fedbens(FusionInputs(one, FusionOptions(temperature=T, progress=False)),
                      FedBEnsSettings(solver="em", prior_centre="clients", server_prior="evidence", steps=20))
    lam = res.info["laplace"]["server_prior_precision"]
    rounds = res.info["server_prior_search"]["rounds"]
    assert len(rounds) == 2 and not res.info["server_prior_search"]["converged"]
    assert lam[0] / res.info["server_prior_search"]["block_scales"][0] == pytest.approx(rounds[-1]["scale"])
    torch.testing.assert_close(res.members[0].double(), _dense_log_evidence(one, T, lam, mu)[1], rtol=1e-5, atol=1e-5)


def test_server_prior_settings_are_checked():
    for bad, match in [(dict(server_prior="evidence", solver="adam"), "needs solver=em"),
                       (dict(server_prior="validation", solver="em"), "server_prior must be one of")]:
        with pytest.raises(posterior_fusion.errors.ConfigError, match=match):
            FedBEnsSettings(**bad).validate()


def test_precision_sum_solve_with_one_shift_per_block_equals_the_dense_solve():
    """`solve_precision_sum` with a shift per block (Kronecker blocks by conjugate gradients, dense ones by
    Cholesky): the dense float64 solve of (Σ_k r_k P_k + blockdiag(s_j I)) w = Σ_k r_k P_k m_k + b."""
    from posterior_fusion.fusion.layer_solve import solve_precision_sum

    gen = torch.Generator().manual_seed(8)
    d = TINY_LAYOUT.dim
    terms = [(0.5 + k, random_curvature("kron", gen), torch.randn(d, generator=gen, dtype=torch.float64))
             for k in range(3)]
    shifts = [0.1, 2.0, 0.5, 7.0]  # one per block of TINY: W1, b1, W2, b2
    rhs = torch.randn(d, generator=gen, dtype=torch.float64)
    ours, info = solve_precision_sum(terms, shift=shifts, rhs=rhs, tolerance=1e-12)
    dense = [torch.block_diag(*[b.to_dense() for b in P.blocks]) for _, P, _ in terms]
    S = torch.diag(torch.cat([torch.full((b.dim,), s, dtype=torch.float64)
                              for b, s in zip(terms[0][1].blocks, shifts)]))
    A = sum(r * D for (r, _, _), D in zip(terms, dense)) + S
    want = torch.linalg.solve(A, sum(r * D @ m for (r, _, m), D in zip(terms, dense)) + rhs)
    torch.testing.assert_close(ours, want, rtol=1e-8, atol=1e-8)
    scalar, _ = solve_precision_sum(terms, shift=0.5, rhs=rhs, tolerance=1e-12)
    A1 = sum(r * D for (r, _, _), D in zip(terms, dense)) + 0.5 * torch.eye(d, dtype=torch.float64)
    torch.testing.assert_close(scalar, torch.linalg.solve(A1, sum(r * D @ m for (r, _, m), D in zip(terms, dense)) + rhs),
                               rtol=1e-8, atol=1e-8)


def test_an_indefinite_dense_block_is_one_clear_error_not_a_traceback():
    """A dense block whose summed precision is indefinite (a shift below minus its smallest eigenvalue) ends in
    :class:`IndefinitePrecisionError` naming the block and its eigenvalue range, not a LinAlgError."""
    from posterior_fusion.errors import IndefinitePrecisionError, PfuseError
    from posterior_fusion.fusion.layer_solve import solve_precision_sum

    gen = torch.Generator().manual_seed(3)
    d = TINY_LAYOUT.dim
    terms = [(1.0, random_curvature("kron", gen), torch.randn(d, generator=gen, dtype=torch.float64))]
    bias = terms[0][1].blocks[1]  # TINY's blocks: W1 (Kronecker), b1 (dense), W2, b2
    low = float(torch.linalg.eigvalsh(bias.to_dense().double())[0])
    with pytest.raises(IndefinitePrecisionError, match=r"curvature block 1 .*not positive definite") as err:
        solve_precision_sum(terms, shift=[0.0, -(low + 1.0), 0.0, 0.0])
    assert isinstance(err.value, PfuseError) and err.value.exit_code == 2


def test_an_indefinite_kronecker_block_is_an_error_where_strict():
    """A Kronecker system shifted below its smallest eigenvalue: with ``strict`` (EM's solves, whose matrix
    Σ r G + λ0 I is positive definite in exact arithmetic) conjugate gradients stop at the first direction of
    non-positive curvature with :class:`IndefinitePrecisionError` naming the block; without it (FedFisher's
    exact solve, which reports an unconverged residual as a warning) they run on and return."""
    from posterior_fusion.errors import IndefinitePrecisionError
    from posterior_fusion.fusion.layer_solve import solve_precision_sum

    gen = torch.Generator().manual_seed(5)
    d = TINY_LAYOUT.dim
    terms = [(1.0, random_curvature("kron", gen), torch.randn(d, generator=gen, dtype=torch.float64))]
    top = float(torch.linalg.eigvalsh(terms[0][1].blocks[0].to_dense().double())[-1])
    shifts = [-2.0 * top, 0.0, 0.0, 0.0]  # W1's system has only negative eigenvalues
    with pytest.raises(IndefinitePrecisionError, match=r"curvature block 0: .*not positive definite"):
        solve_precision_sum(terms, shift=shifts, strict=True)
    w, info = solve_precision_sum(terms, shift=shifts)  # not strict: runs (no math domain error either)
    assert info["iterations"] > 0 and w.shape == (d,)
    good, _ = solve_precision_sum(terms, shift=[0.5] * 4, strict=True, tolerance=1e-12)  # positive definite
    dense = torch.block_diag(*[b.to_dense() for b in terms[0][1].blocks]) + 0.5 * torch.eye(d, dtype=torch.float64)
    want = torch.linalg.solve(dense, (dense - 0.5 * torch.eye(d, dtype=torch.float64)) @ terms[0][2])
    torch.testing.assert_close(good, want, rtol=1e-8, atol=1e-8)


def test_server_prior_evidence_global_artifact_round_trip(tmp_path, fitted):
    """Real kron artifacts fused with `server_prior=evidence` (prior centre clients): one λ0 per block is
    written, read back and used by every predictive (each block's Laplace precision carries its own
    prior precision); a per-block list of the wrong length is refused in one line naming the file."""
    import json

    import h5py

    from posterior_fusion.artifact.reader import load_global
    from posterior_fusion.artifact.writer import text_attr
    from posterior_fusion.data.silo import read_silo
    from posterior_fusion.fusion import write_fused

    folder, paths = fitted
    inputs, result, meta = fuse(paths, "fedbens", FusionOptions(progress=False),
                                {"solver": "em", "prior_centre": "clients", "server_prior": "evidence", "steps": 20})
    lam = result.info["laplace"]["server_prior_precision"]
    blocks = result.curvatures[0].blocks
    assert isinstance(lam, list) and len(lam) == len(blocks) and len(set(lam)) > 1
    out = tmp_path / "g.h5"
    write_fused(out, inputs, result, meta)
    g = load_global(out)
    P = g.precision(0)
    assert [b.shift for b in P.blocks] == pytest.approx(lam)
    v = torch.randn(P.dim, dtype=torch.float64)
    want = sum(blk.quadratic_form(v[o: o + blk.dim].to(blk.dtype)).double() + lam_j * v[o: o + blk.dim].square().sum()
               for blk, o, lam_j in zip(result.curvatures[0].blocks, result.curvatures[0].offsets, lam))
    torch.testing.assert_close(P.quadratic_form(v.to(P.dtype)).double(), want, rtol=1e-4, atol=1e-4)
    x = read_silo(folder / "val.h5").inputs()[:16]
    for predictive in ("map", "mc", "glm", "glm-last-layer"):
        probs = g.predict(x, predictive=predictive, samples=4, raw=True)
        assert probs.shape == (16, 10) and torch.allclose(probs.sum(1), torch.ones(16, dtype=probs.dtype), atol=1e-5)
    bad = tmp_path / "bad.h5"
    bad.write_bytes(out.read_bytes())
    with h5py.File(bad, "r+") as f:
        m = json.loads(bytes(f.attrs["metadata"]).decode())
        m["laplace"]["prior_precision"] = lam[:-1]
        f.attrs["metadata"] = text_attr(json.dumps(m))
    r = CliRunner().invoke(pfuse, ["inspect", str(bad), "--validate"])
    assert r.exit_code == 2 and "laplace.prior_precision" in r.stderr and str(bad) in r.stderr
    assert r.stderr.count("\n") == 1


def test_fedbens_default_is_the_validation_free_fusion_without_validation_data(fitted):
    """``solver=auto`` (the default): without validation data fedbens runs EM with the prior centre at the
    clients and the server prior from the evidence — the same modes as those settings given explicitly — and
    says so in ``resolved``; with validation data it runs the paper's Adam (the same modes as solver=adam);
    an explicit ``solver=em`` keeps the paper's zero centre and the clients' λ0. Adam without validation data
    (only when asked for) warns once, naming the default."""
    import warnings

    from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings, resolve_auto

    folder, paths = fitted
    opts = FusionOptions(progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, auto, auto_meta = fuse(paths, "fedbens", opts, {"steps": 40, "laplace": False})
    assert not [w for w in caught if "without validation data" in str(w.message)]
    assert auto_meta["resolved"] == {"solver": "em", "prior_centre": "clients", "server_prior": "evidence"}
    assert auto_meta["settings"]["solver"] == "auto"  # what was asked, beside what ran
    assert "server_prior_search" in auto_meta
    _, explicit, _ = fuse(paths, "fedbens", opts, {"steps": 40, "laplace": False, "solver": "em",
                                             "prior_centre": "clients", "server_prior": "evidence"})
    for a, b in zip(auto.members, explicit.members):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    val = folder / "val.h5"
    _, with_val, val_meta = fuse(paths, "fedbens", opts, {"steps": 6, "val_every": 2, "laplace": False}, val_path=val)
    _, adam, _ = fuse(paths, "fedbens", opts, {"steps": 6, "val_every": 2, "laplace": False, "solver": "adam"},
                val_path=val)
    assert val_meta["resolved"] == {"solver": "adam", "prior_centre": "prior", "server_prior": "clients"}
    for a, b in zip(with_val.members, adam.members):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # EM where asked for, with or without validation: explicit solver=em keeps the paper's centre and λ0
    assert resolve_auto(FedBEnsSettings(solver="em"), False).prior_centre == "prior"
    assert resolve_auto(FedBEnsSettings(solver="em"), False).server_prior == "clients"
    assert resolve_auto(FedBEnsSettings(server_prior="evidence"), True).solver == "em"
    assert resolve_auto(FedBEnsSettings(trust_radius=0.1), True).solver == "em"
    assert resolve_auto(FedBEnsSettings(prior_centre="prior"), False).prior_centre == "prior"  # explicit wins
    # diagonal curvature: the stationary point predicts far worse than Adam's early iterates (measured), so
    # auto stays the paper's Adam there, without a warning
    for structure in ("diag", "diag+full"):
        assert resolve_auto(FedBEnsSettings(), False, structure).solver == "adam"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, diag_meta = fuse([folder / "diag_0.h5"], "fedbens", opts, {"steps": 2, "laplace": False})
    assert diag_meta["resolved"]["solver"] == "adam"
    assert not [w for w in caught if "without validation data" in str(w.message)]
    with pytest.raises(posterior_fusion.errors.ConfigError, match="server_prior=evidence needs solver=em"):
        FedBEnsSettings.from_mapping({"solver": "adam", "server_prior": "evidence"}, "fedbens")
    with pytest.warns(UserWarning, match="solver=auto"):
        fuse(paths, "fedbens", opts, {"steps": 2, "laplace": False, "solver": "adam"})


def test_the_server_prior_at_the_end_of_its_range_stays_inside_the_readers_range():
    """ρ at the end of its search range is the artifacts' largest prior precision over the largest block scale;
    ρ · c_j rounds one ulp past it for some c_j (1e8 · (1 + 2⁻⁵²)), which the reader would refuse: every λ0_j
    is clamped into the range the reader accepts."""
    from posterior_fusion import ranges
    from posterior_fusion.fusion.methods.fedbens.evidence import server_prior_blocks

    lo, hi = ranges.PRIOR_PRECISION
    scales = [3.0 * 10.0 ** k / 7.0 for k in range(-6, 7)] + [0.1 * k + 0.3 for k in range(1, 40)]
    rounded_past = [c for c in scales if (hi / c) * c > hi]
    assert rounded_past, "no scale rounds past the bound: the test would be empty"
    for c in scales:
        got = server_prior_blocks([c, 0.0], hi / c, 7.0)
        assert lo <= got[0] <= hi and got[1] == 7.0
        ranges.check("prior_precision", got[0], ranges.PRIOR_PRECISION)
