"""The one Gaussian-mixture type: ``Σ_k π_k N(w; μ_k, Λ_k⁻¹)`` with structured precisions.

Client posteriors (their M Laplace components), global ensembles (the Laplace approximations at
the fused modes) and fedbens' objective (its normalising constants) all use it. Shapes: ``w``
``(..., d)``; means ``(d,)`` each; weights ``(K,)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from posterior_fusion.curvature import Precision
from posterior_fusion.predictive import predict

LOG_2PI = math.log(2 * math.pi)


def gaussian_log_norm(logdet: torch.Tensor | float, d: int) -> torch.Tensor | float:
    """``log`` of a Gaussian's normaliser with precision determinant ``exp(logdet)``: ``½ log|Λ| − d/2 log 2π``."""
    return 0.5 * logdet - 0.5 * d * LOG_2PI


def gaussian_log_prob(w: torch.Tensor, mean: torch.Tensor, precision: Precision) -> torch.Tensor:
    """``log N(w; mean, Λ⁻¹)`` ``(...)`` for ``w`` ``(..., d)``, normalised (includes ``½ log|Λ|``)."""
    v = w.to(precision.dtype) - mean.to(precision.dtype)
    return -0.5 * precision.quadratic_form(v) + gaussian_log_norm(precision.logdet(), mean.shape[0])


@dataclass(frozen=True)
class GaussianMixture:
    """``Σ_k π_k N(μ_k, Λ_k⁻¹)``: ``means`` ``(d,)`` each, ``precisions`` (:class:`Precision`),
    ``weights`` π ``(K,)`` (float64, summing to 1)."""

    means: tuple[torch.Tensor, ...]
    precisions: tuple[Precision, ...]
    weights: torch.Tensor

    @classmethod
    def of(cls, means: Sequence[torch.Tensor], precisions: Sequence[Precision],
           weights: torch.Tensor | None = None) -> GaussianMixture:
        """A mixture from its components.

        Args:
            means: K means ``(d,)``.
            precisions: K precisions over ``d`` parameters.
            weights: ``(K,)`` mixture weights [default: equal].

        Returns:
            The :class:`GaussianMixture`.
        """
        k = len(means)
        w = torch.full((k,), 1.0 / k, dtype=torch.float64) if weights is None else torch.as_tensor(weights).double()
        return cls(tuple(means), tuple(precisions), w)

    @property
    def dim(self) -> int:
        return int(self.means[0].shape[0])

    def component_log_probs(self, w: torch.Tensor) -> torch.Tensor:
        """Each component's ``log N(w; μ_k, Λ_k⁻¹)``.

        Args:
            w: weights ``(..., d)``.

        Returns:
            ``(..., K)`` log densities, in the precisions' dtype.
        """
        return torch.stack([gaussian_log_prob(w, m, p) for m, p in zip(self.means, self.precisions)], -1)

    def log_prob(self, w: torch.Tensor) -> torch.Tensor:
        """``log Σ_k π_k N(w; μ_k, Λ_k⁻¹)``.

        Args:
            w: weights ``(..., d)``.

        Returns:
            ``(...)`` log densities, in the precisions' dtype.
        """
        comps = self.component_log_probs(w)
        return torch.logsumexp(comps + self.weights.log().to(comps.dtype), dim=-1)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draws: a component by its weight, then a draw around its mean.

        Args:
            n: how many.
            generator: the random generator [default: torch's global one].

        Returns:
            ``(n, d)`` weights (float64).
        """
        idx = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        out = torch.empty(n, self.dim, dtype=torch.float64)
        for k, (m, p) in enumerate(zip(self.means, self.precisions)):
            rows = (idx == k).nonzero().flatten()
            if len(rows):
                out[rows] = m.double() + p.sample(len(rows), generator).double()
        return out

    def predict(self, spec, x: torch.Tensor, predictive: str = "map", samples: int = 30, scale: float = 1.0,
                link: str = "probit", seed: int = 0, max_memory: int | str | None = None) -> torch.Tensor:
        """Class probabilities of the mixture's predictive (:mod:`posterior_fusion.predictive`).

        Args:
            spec: the model (:class:`ModelSpec`).
            x: the model's inputs ``(n, …)`` (transformed).
            predictive: ``map``, ``mc`` or ``glm``, as :meth:`GlobalEnsemble.predict` takes it.
            samples: draws per component for ``mc`` and ``glm``.
            scale: multiplies the posterior covariance.
            link: ``glm``'s link, ``probit`` or ``mc``.
            seed: the draws' seed.
            max_memory: the GLM predictive's working-set limit.

        Returns:
            ``(n, classes)`` probabilities.
        """
        return predict(spec, list(self.means), x, predictive, list(self.precisions), self.weights, samples, scale,
                       link, seed, max_memory)
