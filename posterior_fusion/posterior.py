"""Typed, immutable posteriors returned by :func:`posterior_fusion.load`: a client's mixture of
Laplace approximations and a fused global ensemble. Their densities, draws and predictives come
from the one mixture type, :class:`posterior_fusion.mixture.GaussianMixture`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import nn

from posterior_fusion.curvature import BlockDiag
from posterior_fusion.data.transform import InputTransform
from posterior_fusion.errors import ConfigError
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.mixture import GaussianMixture, gaussian_log_prob
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.members import (
    InputTransformModule,
    build_model,
    checked_probabilities,
    exported_module,
    model_inputs,
)
from posterior_fusion.pooling import AVERAGE, Pooling
from posterior_fusion.predictive import predict


@dataclass(frozen=True)
class SwagMoments:
    """SWAG moments of one component: ``mean``, ``sq_mean`` ``(d,)``, ``deviations`` ``(K, d)``."""

    mean: torch.Tensor
    sq_mean: torch.Tensor
    deviations: torch.Tensor

    @property
    def diag_variance(self) -> torch.Tensor:
        return (self.sq_mean - self.mean.square()).clamp_min(1e-30)

    def sample(self, n: int, generator: torch.Generator | None = None, scale: float = 1.0) -> torch.Tensor:
        """Draws ``(n, d)`` from the SWAG Gaussian (diagonal + low rank, Maddox et al. 2019)."""
        d, k = self.mean.shape[0], self.deviations.shape[0]
        z1 = torch.randn(n, d, generator=generator, dtype=self.mean.dtype)
        out = z1 * self.diag_variance.sqrt() / math.sqrt(2)
        if k > 1:
            z2 = torch.randn(n, k, generator=generator, dtype=self.mean.dtype)
            out = out + (z2 @ self.deviations) / math.sqrt(2 * (k - 1))
        return self.mean + math.sqrt(scale) * out


@dataclass(frozen=True)
class Component:
    """One mixture component of a client posterior: MAP ``(d,)`` and raw curvature ``G`` (None where it was
    read without it: ``load(…, keep_curvature=False)``)."""

    index: int
    map: torch.Tensor
    curvature: BlockDiag | None
    training: Mapping[str, Any]
    temperature: float
    prior_precision: float
    swag: SwagMoments | None = None
    student: torch.Tensor | None = None  # FedPPD: the distilled posterior-predictive network (d,)
    statistics: torch.Tensor | None = None  # (2 S,): BatchNorm statistics folded into the MAP (models/batchnorm.py)

    def precision(self, temperature: float | None = None, prior_precision: float | None = None) -> BlockDiag:
        """The component's precision ``Λ = G / T + λ0 I``.

        Args:
            temperature: T [default: the client's].
            prior_precision: λ0 [default: the client's].

        Returns:
            A :class:`BlockDiag` over the ``d`` parameters.
        """
        if self.curvature is None:
            raise RuntimeError("this component was loaded without its curvature (keep_curvature=False)")
        t = self.temperature if temperature is None else temperature
        lam = self.prior_precision if prior_precision is None else prior_precision
        return self.curvature.precision(t, lam)

    def sample(self, n: int, generator: torch.Generator | None = None, temperature: float | None = None,
               prior_precision: float | None = None) -> torch.Tensor:
        """Draws from ``N(map, Λ⁻¹)`` (``Precision.sample`` itself is zero-mean).

        Args:
            n: how many.
            generator: the random generator [default: torch's global one].
            temperature: T [default: the client's].
            prior_precision: λ0 [default: the client's].

        Returns:
            ``(n, d)`` weights.
        """
        return self.map + self.precision(temperature, prior_precision).sample(n, generator)

    def log_prob(self, w: torch.Tensor, temperature: float | None = None,
                 prior_precision: float | None = None) -> torch.Tensor:
        """``log N(w; map, Λ⁻¹)``, normalised (``½ log|Λ|`` included).

        Args:
            w: weights ``(..., d)``.
            temperature: T [default: the client's].
            prior_precision: λ0 [default: the client's].

        Returns:
            ``(...)`` log densities.
        """
        return gaussian_log_prob(w.to(self.map.dtype), self.map, self.precision(temperature, prior_precision))


@dataclass(frozen=True)
class ClientPosterior:
    """A client's mixture of Laplace approximations ``q_c(w) = Σ_m π_m N(w; ŵ_m, Λ_m⁻¹)``."""

    path: str
    sha256: str
    model_spec: ModelSpec
    layout: ParameterLayout
    metadata: Mapping[str, Any]
    components: tuple[Component, ...]
    prior_mean: torch.Tensor | None = None  # (d,): the prior N(prior_mean, λ0⁻¹ I)'s centre, the base; None = zero

    @property
    def class_names(self) -> tuple[str, ...]:
        """The classes' names where the data had them (CSV names, image folders), index by index; else ()."""
        return tuple(self.metadata.get("class_names") or ())

    @property
    def structure(self) -> str:
        return str(self.metadata["structure"])

    @property
    def n_data(self) -> int:
        return int(self.metadata["n_data"])

    @property
    def temperature(self) -> float:
        return float(self.metadata["temperature"])

    @property
    def prior_precision(self) -> float:
        return float(self.metadata["prior_precision"])

    @property
    def num_components(self) -> int:
        return len(self.components)

    @property
    def weights(self) -> torch.Tensor:
        """Mixture weights π ``(M,)`` (uniform)."""
        return torch.full((self.num_components,), 1.0 / self.num_components, dtype=torch.float64)

    def mixture(self, temperature: float | None = None, prior_precision: float | None = None) -> GaussianMixture:
        """The client's posterior ``q_c`` as a :class:`GaussianMixture`.

        Args:
            temperature: re-temper it [default: the client's T].
            prior_precision: another prior precision λ0 [default: the client's].

        Returns:
            The mixture of its M components, equally weighted.
        """
        return GaussianMixture.of([c.map for c in self.components],
                                  [c.precision(temperature, prior_precision) for c in self.components], self.weights)

    def log_prob(self, w: torch.Tensor, temperature: float | None = None,
                 prior_precision: float | None = None) -> torch.Tensor:
        """``log q_c(w)`` of the client's mixture.

        Args:
            w: weights ``(..., d)``.
            temperature: re-temper it [default: the client's T].
            prior_precision: another λ0 [default: the client's].

        Returns:
            ``(...)`` log densities.
        """
        return self.mixture(temperature, prior_precision).log_prob(w)

    def predict(self, x: torch.Tensor | np.ndarray, raw: bool = False) -> torch.Tensor:
        """The client's own ensemble: class probabilities averaged over its components' MAPs.

        Args:
            x: inputs as :meth:`GlobalEnsemble.predict` takes them ``(n, …)``.
            raw: ``x`` is already the model's input (the client's input transform is not applied).

        Returns:
            ``(n, classes)`` probabilities.
        """
        x = model_inputs(self.model_spec, self.metadata.get("input_transform"), x, raw, self.path)
        return checked_probabilities(predict(self.model_spec, [c.map for c in self.components], x, "map", None,
                                             self.weights), self.path)

    def model(self, component: int = 0) -> nn.Module:
        """The model with one component's MAP weights.

        Args:
            component: the component's index.

        Returns:
            An ``nn.Module`` of the client's architecture.
        """
        if not 0 <= component < self.num_components:
            raise ConfigError(f"component {component} out of range [0, {self.num_components})")
        return build_model(self.model_spec, self.components[component].map)


@dataclass(frozen=True)
class GlobalEnsemble:
    """Result of ``pfuse fuse``: member weight vectors ``(d,)`` (independent storage), and for
    fedbens a Laplace approximation at each member (global mode): the global posterior is
    approximated by ``Σ_k π_k N(w*_k, Λ*_k⁻¹)`` with ``Λ*_k = curvature_k + λ0 I`` (``λ0`` one number, or one
    per block: metadata ``laplace.prior_precision``)."""

    path: str
    sha256: str
    model_spec: ModelSpec
    layout: ParameterLayout
    metadata: Mapping[str, Any]
    members: tuple[torch.Tensor, ...]
    curvatures: tuple[BlockDiag, ...] | None = None

    @property
    def method(self) -> str:
        return str(self.metadata.get("method", "?"))

    @property
    def class_names(self) -> tuple[str, ...]:
        """The classes' names where the data had them (CSV names, image folders), index by index; else ()."""
        return tuple(self.metadata.get("class_names") or ())

    @property
    def has_posterior(self) -> bool:
        return self.curvatures is not None

    @property
    def mode_weights(self) -> torch.Tensor:
        """Mixture weights π of the members ``(K,)`` (uniform unless the fusion stored others)."""
        w = self.metadata.get("mode_weights")
        k = len(self.members)
        return torch.tensor(w, dtype=torch.float64) if w else torch.full((k,), 1.0 / k, dtype=torch.float64)

    @property
    def pooling(self) -> Pooling:
        """How the members' predictions combine (metadata ``pooling``; the ``mode_weights`` average
        unless the fusion stored another rule, :mod:`posterior_fusion.pooling`)."""
        raw = self.metadata.get("pooling")
        if raw is None:
            return AVERAGE
        return Pooling.from_metadata(raw, len(self.members), self.model_spec.num_classes)

    def precision(self, k: int) -> BlockDiag:
        """``Λ*_k``, the Laplace precision at member ``k``.

        Args:
            k: the member's index.

        Returns:
            A :class:`BlockDiag` over the ``d`` parameters.
        """
        if self.curvatures is None:
            raise ConfigError(f"{self.path}: has no posterior curvature (only fedbens stores one)")
        delta = self.metadata["laplace"]["prior_precision"]  # one number, or one per block
        return self.curvatures[k].precision(1.0, [float(v) for v in delta] if isinstance(delta, list) else float(delta))

    def posterior(self) -> GaussianMixture:
        """The global posterior ``Σ_k π_k N(w*_k, Λ*_k⁻¹)``.

        Returns:
            A :class:`GaussianMixture` of the members with their Laplace precisions.
        """
        return GaussianMixture.of(list(self.members), [self.precision(k) for k in range(len(self.members))],
                                  self.mode_weights)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Draws from the mixture ``Σ_k π_k N(w*_k, Λ*_k⁻¹)``.

        Args:
            n: how many.
            generator: the random generator [default: torch's global one].

        Returns:
            ``(n, d)`` weights.
        """
        return self.posterior().sample(n, generator)

    def log_prob(self, w: torch.Tensor) -> torch.Tensor:
        """``log Σ_k π_k N(w; w*_k, Λ*_k⁻¹)``.

        Args:
            w: weights ``(..., d)``.

        Returns:
            ``(...)`` log densities (float64).
        """
        return self.posterior().log_prob(w).double()

    def predict(self, x: torch.Tensor | np.ndarray, predictive: str = "map", samples: int = 30, scale: float = 1.0,
                link: str = "probit", seed: int = 0, max_memory: int | str | None = None,
                raw: bool = False) -> torch.Tensor:
        """Class probabilities for inputs ``x`` (:mod:`posterior_fusion.predictive`).

        Args:
            x: inputs as a data file stores them (uint8 pixels ``(n, H, W)`` / ``(n, C, H, W)`` or features ``(n, F)``;
                numpy or torch, any real dtype): the clients' input transform is applied.
            predictive: ``map`` (the members), ``mc`` (samples of the Laplace posterior) or ``glm`` (the linearised
                predictive).
            samples: draws per member for ``mc`` and ``glm``.
            scale: multiplies the posterior covariance.
            link: ``glm``'s link, ``probit`` or ``mc``.
            seed: the draws' seed.
            max_memory: the GLM predictive's working-set limit, bytes or a size.
            raw: ``x`` is already the model's input (transformed).

        Returns:
            ``(n, classes)`` probabilities.
        """
        x = model_inputs(self.model_spec, self.metadata.get("input_transform"), x, raw, self.path)
        if self.curvatures is None:  # point estimates only: the map predictive (others refuse in one line)
            probs = predict(self.model_spec, list(self.members), x, predictive, None, self.mode_weights,
                            samples, scale, link, seed, max_memory, self.pooling)
        else:
            probs = self.posterior().predict(self.model_spec, x, predictive, samples, scale, link, seed, max_memory)
        return checked_probabilities(probs, self.path, self.metadata)

    def models(self) -> list[nn.Module]:
        """One fresh network per member, in evaluation mode, of the plain architecture (:meth:`ModelSpec.architecture`; no
        storage shared between them).

        Its ``state_dict`` is complete — a fine-tuned model's frozen weights put back, LoRA merged (``W + B A``), a
        BatchNorm's statistics as buffers — and loads with ``strict=True`` into a fresh module of the spec's
        architecture. They take the model's inputs: data after the artifact's input transform (``predict(x, raw=True)``'s
        inputs); :meth:`models_for_raw_inputs` takes raw data.

        Returns:
            One ``nn.Module`` per member.
        """
        return [exported_module(self.model_spec, w) for w in self.members]

    def models_for_raw_inputs(self) -> list[nn.Module]:
        """:meth:`models`, each behind the artifact's input transform: raw pixels or features in, logits out, as
        ``predict(x)`` takes them.

        Returns:
            One ``nn.Sequential(transform, model)`` per member.
        """
        transform = self.metadata.get("input_transform")
        step = InputTransformModule(InputTransform.from_dict(dict(transform), self.path) if transform else None)
        return [nn.Sequential(step, m).eval() for m in self.models()]


def frozen_mapping(obj: dict) -> Mapping[str, Any]:
    return MappingProxyType(dict(obj))
