"""FedBEns' solvers (fusion/methods/fedbens/solvers.py): Adam with validation, EM, damping, the trust region, the prior centre."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_LAYOUT, client, dense_neg_log_posterior, random_clients, structured_clients

import posterior_fusion
from posterior_fusion.artifact import Component
from posterior_fusion.curvature import BlockDiag, Diag, Kron
from posterior_fusion.fusion import METHODS, FusionInputs, FusionOptions, fuse
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings, GlobalLogPosterior
from posterior_fusion.fusion.mode_laplace import negative_log_posterior

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


def test_fedbens_validation_selection_and_history(fitted):
    folder, paths = fitted
    inputs, result, meta = fuse(paths, "fedbens", FusionOptions(progress=False), {"steps": 30, "val_every": 10},
                                val_path=folder / "val.h5")
    assert len(result.members) == 2
    for hist in meta["history"]:
        assert [h["step"] for h in hist] == [0, 10, 20, 30]
        assert all("val_accuracy" in h for h in hist)
    assert result.members[0].data_ptr() != result.members[1].data_ptr()


@pytest.mark.parametrize("structure", ["kron", "diag", "diag+full"])
def test_em_modes_are_the_dense_minimiser_and_stationary(structure):
    """fedbens `solver=em`: with one component per client the objective is a quadratic and one EM step
    is its dense float64 minimiser (Σ_c Λ_c − (Σ λ_c − λ0) I)⁻¹ Σ_c Λ_c ŵ_c; with mixtures the EM
    modes are stationary points of the dense objective (autograd gradient ≈ 0) reached with the
    objective non-increasing at every iteration."""
    from posterior_fusion.fusion.em import MixtureProduct, em_modes

    T, lams, lam0 = 0.5, [2.0, 2.0, 2.0], 2.0
    one = structured_clients(structure, C=3, M=1, seed=5)
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
    mix = structured_clients(structure, C=3, M=2, seed=6)
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
    one = structured_clients(structure, C=3, M=1, seed=11)
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

    mix = structured_clients(structure, C=3, M=2, seed=12)
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
    mix = structured_clients(structure, C=3, M=2, seed=11)
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
