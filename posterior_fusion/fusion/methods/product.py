"""Closed-form product of client Gaussians over the over-counted prior (diag, diag+full):

    Λ = Σ_c Λ_c − (C−1) λ0 I ,  μ = μ0 + Λ⁻¹ Σ_c Λ_c (ŵ_c − μ0)   (HBFL-style aggregation)

with μ0 the prior's centre: zero from random starting points, the base when the clients fine-tuned one.

Each block position is summed and solved by its own class (``Precision.sum_of``/``solve``);
a structure whose sums leave it (Kronecker) is refused.
"""

from __future__ import annotations

import torch

from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion.settings import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionMethod, FusionResult


def product(inputs: FusionInputs, settings: MethodSettings) -> FusionResult:
    m = inputs.options.component
    comps = [c.components[m] for c in inputs.clients]
    lam0 = inputs.server_prior_precision()
    precs = [comp.precision(inputs.temperature(c), inputs.prior_precision(c)) for comp, c in zip(comps, inputs.clients)]
    # Σ_c Λ_c − Σ_c λ0_c I + λ0 I  (reduces to Σ Λ_c − (C−1) λ0 I for equal priors)
    correction = lam0 - sum(inputs.prior_precision(c) for c in inputs.clients)
    ref = precs[0]
    mu0 = inputs.prior_mean()
    mu0 = torch.zeros(ref.dim, dtype=torch.float64) if mu0 is None else mu0
    out = torch.empty(ref.dim, dtype=torch.float64)
    for j, off in enumerate(ref.offsets):
        blocks = [p.blocks[j] for p in precs]
        centre = mu0[off : off + blocks[0].dim]
        mus = [comp.map[off : off + blocks[0].dim].double() - centre for comp in comps]  # in the prior's coordinates
        try:
            total = type(blocks[0]).sum_of(blocks, correction)
            rhs = sum(type(b).sum_of([b]).astype(torch.float64).matvec(mu) for b, mu in zip(blocks, mus))  # as hbfl
        except MethodNotApplicableError:
            raise MethodNotApplicableError(
                f"method 'product' needs curvature structure diag or diag+full; {inputs.clients[0].path} has "
                f"{inputs.clients[0].structure!r} (a sum of Kronecker products is not Kronecker: use fedbens or fedfisher)"
            ) from None
        out[off : off + blocks[0].dim] = centre + total.astype(torch.float64).solve(rhs)
    return FusionResult([out.float()])


METHOD = FusionMethod("product", product, MethodSettings, "closed-form product of client Gaussians (diag, diag+full)",
                      structures=("diag", "diag+full"))
