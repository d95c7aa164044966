"""HBFL's aggregation (Heterogeneous Bayesian Federated Learning, paper ``003``, eqs. 3.8–3.12).

Each client's tempered likelihood p(D_k|θ)^{1/T} is a scaled Gaussian: its Laplace posterior
N(ŵ_k, (G_k/T_k + λ0 I)⁻¹) divided by the prior N(μ0, λ0⁻¹ I) (eq. 3.8: Λ = Λ1 − Λ2, η = η1 − η2; μ0 zero,
or the base the clients fine-tuned), so its precision is Λ_k = G_k / T_k and its information vector
η_k = (G_k / T_k + λ0) ŵ_k − λ0 μ0. The
global objective is Π_k p(D_k|θ)^{q_k/T} with q_k = n_k / n (eq. 3.12), *without* a global prior:

    Λ = Σ_k q_k Λ_k ,   μ = Λ⁻¹ Σ_k q_k η_k .

(``mean="map"`` takes η_k = G_k / T_k ŵ_k instead: the MAP as the likelihood's mean, the form of
versions before 0.3; kept as a named option because it is bounded where the paper's is not.)

Where G_k is singular the paper's division is ill-posed: a direction without curvature has
Λ_k = 0 but η_k = λ0 ŵ_k ≠ 0 (at an exact MAP ŵ_k is 0 there). So the prior term is kept only
where the client has curvature: η_k = G_k/T_k ŵ_k + λ0 Π_k ŵ_k. By default Π_k projects onto the
eigen-directions of each block of G_k/T_k whose eigenvalue float32 curvature resolves (above
:data:`NULL_RESOLUTION` × the block's largest): Π_k = I wherever G_k has full rank, so the default is
eq. 3.8 itself there, and directions of rounding noise get no prior term. ``null_tol`` = a number gives
the soft projector Π_k = G_k/T_k (G_k/T_k + ε_k I)⁻¹, ε_k = null_tol × mean(diag G_k/T_k), which moves
the mean by about null_tol × (mean curvature / eigenvalue)² along weakly curved directions. Directions no client has curvature in make Λ
singular; ``prior_scale`` > 0 adds ε I with ε = prior_scale × mean(diag Λ) to Λ and ε Σ q_k ŵ_k to the
right-hand side, i.e. those directions fall back to FedAvg (the limit ε → 0 of a vanishing
prior centred on FedAvg). diag and diag+full: closed form per block. kron: Σ of Kronecker
products is not Kronecker, so μ minimises ½ wᵀ Λ w − wᵀ Σ_k q_k η_k (equal, up to a constant,
to ½ Σ_k q_k (w − ŵ_k)ᵀ Λ_k (w − ŵ_k) − wᵀ Σ_k q_k λ0 Π_k ŵ_k): by default (``solver = "adam"``) with
FedFisher's optimiser started from FedAvg, with ``solver = "exact"`` by conjugate gradients per
layer — the closed form itself (``fusion/quadratic.py``).

HBFL's heterogeneous clients (private architectures distilled into the shared model) are a
client-side step and not part of this aggregation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from posterior_fusion.choices import Choice
from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.curvature.base import eigh_psd
from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.quadratic import QuadraticSettings, minimise_quadratic, quadratic_bytes
from posterior_fusion.fusion.settings_parsing import setting
from posterior_fusion.fusion.types import FusionInputs, FusionResult


class HbflMean(Choice):
    """HBFL's information vector."""

    PAPER = "paper", "eq. 3.8's (G_k/T_k + λ0) ŵ_k (the posterior divided by the prior)"
    MAP = "map", "G_k/T_k ŵ_k (the MAP as the likelihood's mean)"


NULL_RESOLUTION = 1e-7  # eigenvalues below this × the block's largest are float32 rounding, not curvature


@dataclass(frozen=True)
class HBFLSettings(QuadraticSettings):
    """HBFL: the information vector's form, and the solver for Kronecker curvature (diag and
    diag+full are solved in closed form whatever ``solver`` says)."""

    mean: str = setting("paper", "The information vector of each client.", choices=HbflMean)
    null_tol: float | None = setting(None, "paper mean: where a client's prior term λ0 ŵ_k is kept. None: along every "
                                           "eigen-direction of G_k/T_k whose eigenvalue the float32 curvature resolves "
                                           "(> 1e-7 × the block's largest), none other — eq. 3.8 exactly "
                                           "wherever G_k has full rank; a number: the soft projector G_k/T_k (G_k/T_k "
                                           "+ ε I)⁻¹ with ε = null_tol × the mean curvature.", bounds=(1e-12, 1))



def prior_information(comp, temperature: float, prior_precision: float, null_tol: float | None,
                      prior_mean: torch.Tensor | None = None) -> torch.Tensor:
    """``λ0 Π (ŵ − μ0)`` ``(d,)`` float64 (μ0 = ``prior_mean``, the prior's centre: the base the clients fine-tuned,
    default zero): the prior's part of eq. 3.8's information vector, kept only where the client
    has curvature. ``null_tol`` None: ``Π`` projects onto the eigen-directions of each block of ``G/T`` with an
    eigenvalue above :data:`NULL_RESOLUTION` × the block's largest (what float32 curvature resolves), so
    ``Π ŵ = ŵ`` where ``G`` has full rank; a number: the soft projector ``Π = G/T (G/T + εI)⁻¹``,
    ``ε = null_tol · mean diag(G/T)`` (``Π ŵ = ŵ − ε (G/T + εI)⁻¹ ŵ``)."""
    w = comp.map.double() if prior_mean is None else comp.map.double() - prior_mean.double()
    if null_tol is None:
        return prior_precision * torch.cat([_resolved_part(b, w[off : off + b.dim])
                                            for b, off in zip(comp.curvature.blocks, comp.curvature.offsets)])
    eps = null_tol * float(comp.curvature.diagonal().double().mean()) / temperature
    if eps <= 0:  # no curvature at all: nothing of the prior survives the division
        return torch.zeros_like(w)
    damped = _float64(comp.curvature).with_scale_shift(1.0 / temperature, eps)
    solved = torch.cat([b.solve(w[off : off + b.dim].to(b.dtype)).double()  # blocks differ in dtype
                        for b, off in zip(damped.blocks, damped.offsets)])
    return prior_precision * (w - eps * solved)


def _resolved(values: torch.Tensor) -> torch.Tensor:
    """Which eigenvalues (any shape) exceed :data:`NULL_RESOLUTION` × the largest; none if there is no curvature."""
    top = values.max() if values.numel() else values.new_zeros(())
    return values > NULL_RESOLUTION * top if top > 0 else torch.zeros_like(values, dtype=torch.bool)


def _resolved_part(block, v: torch.Tensor) -> torch.Tensor:
    """``v`` ``(p,)`` projected onto the eigen-directions of ``block`` whose eigenvalue is resolved
    (:func:`_resolved`; float64; a Kronecker block's eigenvalues are the products ``b_i a_j``, its
    projection ``U_B (mask ∘ U_Bᵀ V U_A) U_Aᵀ``)."""
    if isinstance(block, Kron):
        b, UB, a, UA = (t.double() for t in block.eigen())
        V = v.reshape(b.numel(), a.numel())
        return (UB @ ((UB.T @ V @ UA) * _resolved(torch.outer(b, a))) @ UA.T).reshape(-1)
    if block.kind == "diag":
        return torch.where(_resolved(block.diagonal().double()), v, torch.zeros_like(v))
    values, U = eigh_psd(block.to_dense().double())
    keep = _resolved(values)
    return U[:, keep] @ (U[:, keep].T @ v)


def _float64(curvature: BlockDiag) -> BlockDiag:
    """A float64 copy of the blocks that have one (``sum_of`` of one block), so the nearly singular
    ``G/T + εI`` is solved accurately; Kronecker blocks solve through their eigenbases as they are."""
    blocks = []
    for b in curvature.blocks:
        try:
            blocks.append(type(b).sum_of([b]))
        except MethodNotApplicableError:
            blocks.append(b)
    return BlockDiag(blocks)


def hbfl(inputs: FusionInputs, settings: HBFLSettings) -> FusionResult:
    m = inputs.options.component
    comps = [c.components[m] for c in inputs.clients]
    n = torch.tensor([float(c.n_data) for c in inputs.clients], dtype=torch.float64)
    q = n / n.sum()  # (C,) q_k = n_k / n, in float64 (Λ may be ill-conditioned without a prior)
    temps = [inputs.temperature(c) for c in inputs.clients]
    avg = (q[:, None] * torch.stack([comp.map.double() for comp in comps])).sum(0)  # FedAvg, float64
    # Σ_k q_k λ0 Π_k ŵ_k: what dividing each posterior by its prior adds to the information vector
    extra = torch.zeros_like(avg)
    if settings.mean == "paper":
        for qk, comp, t, c in zip(q, comps, temps, inputs.clients):
            extra += float(qk) * prior_information(comp, t, inputs.prior_precision(c), settings.null_tol,
                                                   inputs.prior_mean())
    if inputs.clients[0].structure != "kron":  # Σ of diagonal or dense blocks: closed form
        settings = dataclasses.replace(settings, solver="exact")
    # q_k Λ_k = q_k G_k / T_k: the curvature tempered at T_k / q_k, no prior
    out = minimise_quadratic(comps, [float(qk) / t for qk, t in zip(q, temps)], inputs, settings, "hbfl", avg,
                             linear=extra)
    out.info["q"] = [float(v) for v in q]
    return out


METHOD = FusionMethod("hbfl", hbfl, HBFLSettings,
                      "HBFL's aggregation: q_k-weighted product of the clients' scaled Gaussian likelihoods, no prior",
                      optimises=True, work_bytes=quadratic_bytes, dense_copies=3)
