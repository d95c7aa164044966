"""HBFL's aggregation (Heterogeneous Bayesian Federated Learning, paper ``003``, eqs. 3.8–3.12).

Each client's tempered likelihood p(D_k|θ)^{1/T} is a scaled Gaussian: its posterior divided by
the prior (eq. 3.8), precision Λ_k = G_k / T_k (the Laplace posterior precision minus the prior
precision) and mean ŵ_k. The global objective is Π_k p(D_k|θ)^{q_k/T} with q_k = n_k / n
(eq. 3.12), *without* a global prior, so

    Λ = Σ_k q_k Λ_k ,   μ = Λ⁻¹ Σ_k q_k Λ_k ŵ_k .

diag and diag+full: closed form per block. Directions no client has curvature in make Λ
singular; ``damping`` > 0 adds ε I with ε = damping × mean(diag Λ) to Λ and ε Σ q_k ŵ_k to the
right-hand side, i.e. those directions fall back to FedAvg (the limit ε → 0 of a vanishing
prior centred on FedAvg). kron: Σ of Kronecker products is not Kronecker, so μ minimises
½ Σ_k q_k (w − ŵ_k)ᵀ Λ_k (w − ŵ_k) with FedFisher's optimiser, started from FedAvg.

HBFL's heterogeneous clients (private architectures distilled into the shared model) are a
client-side step and not part of this aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posterior_fusion.errors import ConfigError, MethodNotApplicableError
from posterior_fusion.fusion.common import FusionInputs, FusionMethod, FusionResult
from posterior_fusion.fusion.optimise import OptimiserSettings, optimise_modes
from posterior_fusion.fusion.settings import setting
from posterior_fusion.fusion.stack import StackedGaussians


@dataclass(frozen=True)
class HBFLSettings(OptimiserSettings):
    """HBFL: damping of the closed form, and the optimiser for Kronecker curvature."""

    damping: float = setting(1e-8, "Relative damping ε / mean(diag Λ) of the closed form (directions without "
                                   "curvature fall back to FedAvg).", bounds=(0, 1))

    def validate(self) -> None:
        super().validate()
        if not (0 <= self.damping < 1):
            raise ConfigError("hbfl setting 'damping' must be in [0, 1)")


def hbfl(inputs: FusionInputs, settings: HBFLSettings) -> FusionResult:
    m = inputs.options.component
    comps = [c.components[m] for c in inputs.clients]
    n = torch.tensor([float(c.n_data) for c in inputs.clients], dtype=torch.float64)
    q = n / n.sum()  # (C,) q_k = n_k / n, in float64 (Λ may be ill-conditioned without a prior)
    temps = [inputs.temperature(c) for c in inputs.clients]
    avg = (q[:, None] * torch.stack([comp.map.double() for comp in comps])).sum(0)  # FedAvg, float64
    if inputs.clients[0].structure == "kron":
        opts = inputs.options
        stack = StackedGaussians(comps, scale=[float(qk) / t for qk, t in zip(q, temps)], shift=0.0,
                                 kernel=opts.kernel).to(opts.device)

        def objective(W):
            return 0.5 * stack.quadratic_forms(W).sum(-1)

        best, history = optimise_modes(objective, avg.float()[None], inputs, settings, "hbfl")
        return FusionResult([best[0].clone()], {"history": history})
    # q_k Λ_k = q_k G_k / T_k: the curvature tempered at T_k / q_k, no prior
    precs = [comp.curvature.with_scale_shift(float(qk) / t, 0.0) for comp, t, qk in zip(comps, temps, q)]
    ref = precs[0]
    out = torch.empty(ref.dim, dtype=torch.float64)
    for j, off in enumerate(ref.offsets):
        blocks = [p.blocks[j] for p in precs]
        size = blocks[0].dim
        # in float64 (sum_of of one block is its float64 copy): Λ can be ill-conditioned without a prior
        rhs = sum(type(b).sum_of([b]).matvec(comp.map[off : off + size].double()) for b, comp in zip(blocks, comps))
        eps = settings.damping * float(sum(b.diagonal().double().sum() for b in blocks)) / size
        try:
            total = type(blocks[0]).sum_of(blocks, eps)
        except MethodNotApplicableError:  # pragma: no cover - kron is handled above
            raise MethodNotApplicableError(f"hbfl cannot sum {blocks[0].kind} blocks in closed form") from None
        out[off : off + size] = total.solve(rhs + eps * avg[off : off + size].double())
    return FusionResult([out.float()], {"q": [float(v) for v in q]})


METHOD = FusionMethod("hbfl", hbfl, HBFLSettings,
                      "HBFL's aggregation: q_k-weighted product of the clients' scaled Gaussian likelihoods, no prior",
                      optimises=True)
