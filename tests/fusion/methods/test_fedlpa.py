"""FedLPA (fusion/methods/fedlpa.py) against a dense solve of its equations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_LAYOUT, random_clients, random_psd

from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.fusion import METHODS, FusionInputs, FusionOptions

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


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
