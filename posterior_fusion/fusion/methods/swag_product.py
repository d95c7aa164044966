"""A SWAG global posterior: the product of the clients' SWAG Gaussians over the over-counted prior.

Client k's SWAG Gaussian (Maddox et al. 2019) has covariance Σ_k = D_k + U_k U_kᵀ with
D_k = ½ diag(v_k) and U_k = Dev_kᵀ / √(2(K−1)) ``(d, K)``. By Woodbury its precision is a
diagonal minus a rank-K term, Σ_k⁻¹ = diag(1/D_k) − V_k V_kᵀ with
V_k = D_k⁻¹ U_k (I + U_kᵀ D_k⁻¹ U_k)^{-1/2}. The global precision and mean,

    Λ = Σ_k (Σ_k⁻¹ − λ0_k I) + λ0 I = diag(δ) − V Vᵀ ,   μ = Λ⁻¹ (Σ_k Σ_k⁻¹ μ_k + (λ0 − Σ_k λ0_k) μ0) ,

(V = [V_1 … V_C], ``(d, C·K)``; μ0 the prior's centre: zero, or the base the clients fine-tuned) are solved with Woodbury once more:
Λ⁻¹ = Δ⁻¹ + Δ⁻¹ V M⁻¹ Vᵀ Δ⁻¹ with M = I − Vᵀ Δ⁻¹ V; samples are
μ + Δ^{-1/2} z₁ + Δ⁻¹ V M^{-1/2} z₂. Nothing ``(d, d)`` is formed: memory O(d·C·K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from posterior_fusion.errors import ConfigError, MethodNotApplicableError
from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.settings_parsing import MethodSettings, setting
from posterior_fusion.fusion.types import FusionInputs, FusionResult
from posterior_fusion.posterior import SwagMoments


def _inv_sqrt_psd(M: torch.Tensor, what: str) -> torch.Tensor:
    """``M^{-1/2}`` of a symmetric positive-definite matrix (raises if it is not)."""
    evals, evecs = torch.linalg.eigh(0.5 * (M + M.T))
    if not bool(evals.min() > 1e-12 * evals.abs().max().clamp_min(1.0)):
        raise MethodNotApplicableError(f"the SWAG product is not positive definite ({what}); a larger prior "
                                       "variance or the 'swag' ensemble avoids this")
    return (evecs * evals.rsqrt()) @ evecs.T


def swag_precision(m: SwagMoments, min_variance: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1/D (d,), V (d, K))`` with ``Σ⁻¹ = diag(1/D) − V Vᵀ`` for one SWAG Gaussian, float64;
    the diagonal variance is floored at ``min_variance``."""
    D = 0.5 * m.diag_variance.double().clamp_min(min_variance)
    K = m.deviations.shape[0]
    if K <= 1:
        return 1.0 / D, torch.zeros(D.shape[0], 0, dtype=torch.float64)
    U = m.deviations.double().T / math.sqrt(2 * (K - 1))
    DiU = U / D[:, None]
    core = torch.eye(K, dtype=torch.float64) + U.T @ DiU
    evals, evecs = torch.linalg.eigh(0.5 * (core + core.T))  # I + Uᵀ D⁻¹ U is PD: eigenvalues >= 1
    return 1.0 / D, DiU @ ((evecs * evals.rsqrt()) @ evecs.T)


@dataclass(frozen=True)
class SwagProduct:
    """The global Gaussian N(mean, Λ⁻¹) with Λ = diag(delta) − V Vᵀ (float64).

    ``mean`` ``(d,)``, ``delta`` ``(d,)``, ``V`` ``(d, R)``, ``m_inv_sqrt`` = M^{-1/2} ``(R, R)``."""

    mean: torch.Tensor
    delta: torch.Tensor
    V: torch.Tensor
    m_inv_sqrt: torch.Tensor

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n, d)`` draws."""
        d, r = self.V.shape
        z1 = torch.randn(n, d, generator=generator, dtype=torch.float64)
        z2 = torch.randn(n, r, generator=generator, dtype=torch.float64)
        return self.mean + z1 * self.delta.rsqrt() + (z2 @ self.m_inv_sqrt @ (self.V / self.delta[:, None]).T)

    def precision_dense(self) -> torch.Tensor:
        """``Λ`` ``(d, d)`` — for tests on small models."""
        return torch.diag(self.delta) - self.V @ self.V.T

    def sampling_covariance_dense(self) -> torch.Tensor:
        """Covariance of :meth:`sample`'s draws ``(d, d)``, from its own factors — for tests."""
        B = (self.V / self.delta[:, None]) @ self.m_inv_sqrt
        return torch.diag(1.0 / self.delta) + B @ B.T


def multiply(moments: list[SwagMoments], prior_precisions: list[float], server_prior_precision: float,
             min_variance: float = 0.0, prior_mean: torch.Tensor | None = None) -> SwagProduct:
    """The product of the SWAG Gaussians over the over-counted prior (module docstring), the prior
    centred at ``prior_mean`` ``(d,)`` (a base; default zero)."""
    parts = [swag_precision(m, min_variance) for m in moments]
    delta = sum(p[0] for p in parts) + (server_prior_precision - sum(prior_precisions))
    if not bool((delta > 0).all()):
        raise MethodNotApplicableError("the SWAG product is not positive definite (the over-counted prior exceeds "
                                       "the clients' diagonal precision); a larger prior variance avoids this")
    V = torch.cat([p[1] for p in parts], dim=1)
    rhs = sum(p[0] * m.mean.double() - p[1] @ (p[1].T @ m.mean.double()) for p, m in zip(parts, moments))
    if prior_mean is not None:  # the prior terms' information (λ0 − Σ_c λ_c) μ0
        rhs = rhs + (server_prior_precision - sum(prior_precisions)) * prior_mean.double()
    DiV = V / delta[:, None]
    M = torch.eye(V.shape[1], dtype=torch.float64) - V.T @ DiV
    m_inv_sqrt = _inv_sqrt_psd(M, "I − Vᵀ Δ⁻¹ V") if V.shape[1] else M
    w = rhs / delta
    mean = w + DiV @ (m_inv_sqrt @ (m_inv_sqrt @ (V.T @ w))) if V.shape[1] else w
    return SwagProduct(mean, delta, V, m_inv_sqrt)


@dataclass(frozen=True)
class SwagProductSettings(MethodSettings):
    num_samples: int = setting(0, "Draws from the global Gaussian as ensemble members (0: its mean only).", bounds=(0, 10_000))
    min_variance: float = setting(1e-8, "Floor of each SWAG diagonal variance (float32 running moments give 0 for "
                                        "weights that barely move; an unfloored precision of 1e30 ruins the "
                                        "Woodbury solve).", bounds=(0, 1e6))

    def validate(self) -> None:
        super().validate()
        if self.num_samples < 0 or not self.min_variance >= 0:
            raise ConfigError("swag-product settings need num_samples >= 0 and min_variance >= 0")


def swag_product(inputs: FusionInputs, settings: SwagProductSettings) -> FusionResult:
    m = inputs.options.component
    moments = []
    for c in inputs.clients:
        comp = c.components[m]
        if comp.swag is None:
            raise MethodNotApplicableError(f"method 'swag-product' needs SWAG moments; {c.path} component "
                                           f"{comp.index} has none (fit-local `swag`)")
        moments.append(comp.swag)
    prod = multiply(moments, [inputs.prior_precision(c) for c in inputs.clients], inputs.server_prior_precision(),
                    settings.min_variance, inputs.prior_mean())
    if settings.num_samples == 0:
        return FusionResult([prod.mean.float()], {"swag_product_rank": int(prod.V.shape[1])})
    gen = torch.Generator().manual_seed(inputs.options.sampling_seed)
    return FusionResult([w.float().clone() for w in prod.sample(settings.num_samples, gen)],
                        {"swag_product_rank": int(prod.V.shape[1])})


METHOD = FusionMethod("swag-product", swag_product, SwagProductSettings,
                      "product of the clients' SWAG Gaussians over the over-counted prior (Woodbury, no d x d)",
                      needs=("swag_moments",))
