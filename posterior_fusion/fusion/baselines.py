"""Closed-form and simple baselines on the same artifacts (one function per method).

Unimodal baselines use component ``options.mode_index`` (default 0) of every client: those
components share their starting point across clients (shared init), as one-shot FedAvg needs.
"""

from __future__ import annotations

import torch

from posterior_fusion.curvature import Dense, Diag, Kron
from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion.common import FusionInputs, FusionResult, require_structures


def fedavg(inputs: FusionInputs) -> FusionResult:
    """n-weighted mean of the clients' MAPs."""
    W = inputs.mode_maps()
    return FusionResult([(inputs.n_weights()[:, None] * W).sum(0)])


def ensemble(inputs: FusionInputs) -> FusionResult:
    """Every component of every client as an ensemble member (prediction averaging)."""
    return FusionResult([comp.map.float().clone() for c in inputs.clients for comp in c.components])


def fisher_merge(inputs: FusionInputs) -> FusionResult:
    """Σ_c diag(G_c) ŵ_c / Σ_c diag(G_c), FedAvg where Σ_c diag(G_c) ≈ 0 (Matena & Raffel).

    Uses the diagonal of whatever curvature the clients stored (diag, or the diagonal of
    K-FAC / the full block).
    """
    m = inputs.options.mode_index
    W = inputs.mode_maps()
    F = torch.stack([c.components[m].curvature.diagonal().float() for c in inputs.clients])
    num, den = (F * W).sum(0), F.sum(0)
    avg = (inputs.n_weights()[:, None] * W).sum(0)
    tiny = den <= 1e-12 * den.max().clamp_min(1e-30)
    merged = torch.where(tiny, avg, num / den.clamp_min(1e-30))
    return FusionResult([merged], {"fedavg_fallback_params": int(tiny.sum())})


def product(inputs: FusionInputs) -> FusionResult:
    """Closed-form product of client Gaussians over the over-counted prior (diag, diag+full).

    Λ = Σ_c Λ_c − (C−1) λ0 I ,  μ = Λ⁻¹ Σ_c Λ_c ŵ_c   (prior mean 0; HBFL aggregation).
    """
    require_structures(inputs, ("diag", "diag+full"), "product",
                       " (a sum of Kronecker products is not Kronecker: use fedbens or fedfisher)")
    m = inputs.options.mode_index
    comps = [c.components[m] for c in inputs.clients]
    lam0 = inputs.server_prior_precision()
    precs = [comp.precision(inputs.temperature(c), inputs.prior_precision(c)) for comp, c in zip(comps, inputs.clients)]
    lam_c = [inputs.prior_precision(c) for c in inputs.clients]
    ref = precs[0]
    out = torch.empty(ref.dim, dtype=torch.float64)
    for j, off in enumerate(ref.offsets):
        blocks = [p.blocks[j] for p in precs]
        mus = [comp.map[off : off + blocks[0].dim] for comp in comps]  # same dtype as the curvature
        # Σ_c Λ_c − Σ_c λ0_c I + λ0 I  (reduces to Σ Λ_c − (C−1) λ0 I for equal priors)
        correction = lam0 - sum(lam_c)
        rhs = sum(b.matvec(mu).double() for b, mu in zip(blocks, mus))
        if isinstance(blocks[0], Diag):
            diag = sum(b.diagonal().double() for b in blocks) + correction
            out[off : off + blocks[0].dim] = rhs / diag
        elif isinstance(blocks[0], Dense):
            L = sum(b.to_dense().double() for b in blocks) + correction * torch.eye(blocks[0].dim, dtype=torch.float64)
            out[off : off + blocks[0].dim] = torch.linalg.solve(L, rhs)
        else:  # pragma: no cover - excluded by require_structures
            raise MethodNotApplicableError("product: unsupported block")
    return FusionResult([out.float()])


def regmean(inputs: FusionInputs) -> FusionResult:
    """RegMean (Jin et al.) from the K-FAC input factors: for each weight ``(out, in)``

        W* = (Σ_c W_c G_c)(Σ_c G_c)⁻¹ ,   G_c = n_c · A_c  (A_c = mean of x xᵀ on client c)

    with RegMean's α scaling the off-diagonal Gram entries; other parameters are n-averaged.
    """
    require_structures(inputs, ("kron",), "regmean", " (it needs the K-FAC input factors)")
    m = inputs.options.mode_index
    alpha = inputs.options.regmean_alpha
    avg = fedavg(inputs).members[0]
    out = avg.clone()
    ref = inputs.clients[0].components[m].curvature
    for j, (block, off) in enumerate(zip(ref.blocks, ref.offsets)):
        if not isinstance(block, Kron):
            continue
        shape = block.shape
        num = torch.zeros(shape, dtype=torch.float64)
        den = torch.zeros(shape[1], shape[1], dtype=torch.float64)
        for c in inputs.clients:
            comp = c.components[m]
            A = comp.curvature.blocks[j].A.double() * c.n_data
            A = alpha * A + (1 - alpha) * torch.diag(torch.diagonal(A))
            W = comp.map[off : off + block.dim].double().reshape(shape)
            num += W @ A
            den += A
        den += 1e-8 * torch.diagonal(den).mean().clamp_min(1e-30) * torch.eye(shape[1], dtype=torch.float64)
        merged = torch.linalg.solve(den, num.T).T  # den is symmetric: (num den⁻¹)ᵀ = den⁻¹ numᵀ
        out[off : off + block.dim] = merged.reshape(-1).float()
    return FusionResult([out])
