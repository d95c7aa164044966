"""Closed-form product of client Gaussians over the over-counted prior (diag, diag+full):

    Λ = Σ_c Λ_c − (C−1) λ0 I ,  μ = μ0 + Λ⁻¹ Σ_c Λ_c (ŵ_c − μ0)   (HBFL-style aggregation)

with μ0 the prior's centre: zero from random starting points, the base when the clients fine-tuned one.

Each block position is summed and solved by its own class (``Precision.sum_of``/``solve``);
a structure whose sums leave it (Kronecker) is refused. With diagonal curvature the server step reads three
sums over clients only (:data:`SUMS`: ``Σ_c Λ_c (ŵ_c − μ0)``, ``Σ_c Λ_c``, ``Σ_c λ0_c``).
"""

from __future__ import annotations

import torch

from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion.client_sums import ClientSums, SumsContext
from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionResult


def product_local(inputs: FusionInputs, settings: MethodSettings) -> list[torch.Tensor]:
    """The one client's ``[Λ_c ⊙ (ŵ_c − μ0) (d,), diag(Λ_c) (d,), λ0_c (1,)]``, float64 (diagonal curvature only)."""
    c = inputs.clients[0]
    if c.structure != "diag":
        raise MethodNotApplicableError(f"method 'product' runs from sums over clients with curvature structure diag "
                                       f"only; {c.path} has {c.structure!r}")
    w = inputs.mode_maps()[0].double()
    lam0 = inputs.prior_precision(c)
    prec = c.components[inputs.options.component].precision(inputs.temperature(c), lam0).diagonal().double()
    mu0 = inputs.prior_mean()
    return [prec * (w if mu0 is None else w - mu0), prec, torch.tensor([lam0], dtype=torch.float64)]


def product_finish(sums: list[torch.Tensor], context: SumsContext, settings: MethodSettings) -> FusionResult:
    """``μ = μ0 + (Σ Λ_c + λ0 − Σ λ0_c)⁻¹ Σ Λ_c (ŵ_c − μ0)`` element-wise."""
    total = sums[1] + (context.prior_precision - sums[2])
    delta = sums[0] / total
    return FusionResult([(delta if context.prior_mean is None else context.prior_mean + delta).float()])


SUMS = ClientSums(product_local, product_finish, structures=("diag",))


def product(inputs: FusionInputs, settings: MethodSettings) -> FusionResult:
    if inputs.clients[0].structure == "diag":
        return SUMS.run(inputs, settings)
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
                      structures=("diag", "diag+full"), sums=SUMS)
