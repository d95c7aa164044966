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
from torch.nn.utils import vector_to_parameters

from posterior_fusion.curvature import BlockDiag
from posterior_fusion.data.transform import InputTransform
from posterior_fusion.errors import ConfigError, NonFiniteOutputError, shown
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.mixture import GaussianMixture, gaussian_log_prob
from posterior_fusion.models import ModelSpec
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


def exported_state(spec: ModelSpec, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of :meth:`ModelSpec.architecture` for a member's flat ``weights`` ``(d,)``: trained and
    frozen weights, LoRA merged, a BatchNorm's statistics (its batch counter the architecture's own)."""
    from posterior_fusion.models.finetune import merged_state

    state = merged_state(build_model(spec, weights))
    with torch.device("meta"):
        wanted = spec.architecture().state_dict()
    missing = [k for k in wanted if k not in state and not k.endswith("num_batches_tracked")]
    if missing:
        raise ConfigError(f"model {spec.name!r}: no exported value for {', '.join(missing[:3])}")
    return {k: (state[k].detach().clone().contiguous() if k in state else torch.zeros((), dtype=torch.long))
            for k in wanted}


def exported_module(spec: ModelSpec, weights: torch.Tensor) -> nn.Module:
    """A fresh :meth:`ModelSpec.architecture` module holding :func:`exported_state`, in evaluation mode."""
    model = spec.architecture()
    model.load_state_dict(exported_state(spec, weights), strict=True)
    return model.eval()


class InputTransformModule(nn.Module):
    """An artifact's input transform as a module (raw data in, the model's inputs out; None: the identity)."""

    def __init__(self, transform: InputTransform | None) -> None:
        super().__init__()
        self.transform = transform

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform is None:
            return x.float()
        return self.transform.apply(x.detach().cpu().numpy(), "inputs").to(x.device)


def build_model(spec: ModelSpec, weights: torch.Tensor) -> nn.Module:
    """A fresh model of ``spec`` with the flat ``weights`` ``(d,)`` copied in (independent storage)."""
    model = spec.build()
    vector_to_parameters(weights.detach().clone().to(torch.float32), model.parameters())
    model.eval()
    return model


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
        """``Λ = G / T + λ0 I`` (defaults: the client's T and λ0)."""
        if self.curvature is None:
            raise RuntimeError("this component was loaded without its curvature (keep_curvature=False)")
        t = self.temperature if temperature is None else temperature
        lam = self.prior_precision if prior_precision is None else prior_precision
        return self.curvature.precision(t, lam)

    def sample(self, n: int, generator: torch.Generator | None = None, temperature: float | None = None,
               prior_precision: float | None = None) -> torch.Tensor:
        """``n`` draws ``(n, d)`` from ``N(map, Λ⁻¹)`` (``Precision.sample`` itself is zero-mean)."""
        return self.map + self.precision(temperature, prior_precision).sample(n, generator)

    def log_prob(self, w: torch.Tensor, temperature: float | None = None,
                 prior_precision: float | None = None) -> torch.Tensor:
        """``log N(w; map, Λ⁻¹)`` for ``w`` ``(..., d)``, normalised (includes ``½ log|Λ|``)."""
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
        """``q_c`` as a :class:`GaussianMixture` (optionally re-tempered or with another prior)."""
        return GaussianMixture.of([c.map for c in self.components],
                                  [c.precision(temperature, prior_precision) for c in self.components], self.weights)

    def log_prob(self, w: torch.Tensor, temperature: float | None = None,
                 prior_precision: float | None = None) -> torch.Tensor:
        """``log q_c(w)`` of the mixture for ``w`` ``(..., d)``."""
        return self.mixture(temperature, prior_precision).log_prob(w)

    def predict(self, x: torch.Tensor | np.ndarray, raw: bool = False) -> torch.Tensor:
        """The client's own ensemble: class probabilities ``(n, classes)`` averaged over its
        components' MAPs; ``x`` as :meth:`GlobalEnsemble.predict` takes it (the client's input
        transform applied unless ``raw``)."""
        x = model_inputs(self.model_spec, self.metadata.get("input_transform"), x, raw, self.path)
        return checked_probabilities(predict(self.model_spec, [c.map for c in self.components], x, "map", None,
                                             self.weights), self.path)

    def model(self, component: int = 0) -> nn.Module:
        """The model with component ``component``'s MAP weights."""
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
        """``Λ*_k``, the Laplace precision at member ``k``."""
        if self.curvatures is None:
            raise ConfigError(f"{self.path}: has no posterior curvature (only fedbens stores one)")
        delta = self.metadata["laplace"]["prior_precision"]  # one number, or one per block
        return self.curvatures[k].precision(1.0, [float(v) for v in delta] if isinstance(delta, list) else float(delta))

    def posterior(self) -> GaussianMixture:
        """The global posterior ``Σ_k π_k N(w*_k, Λ*_k⁻¹)`` as a :class:`GaussianMixture`."""
        return GaussianMixture.of(list(self.members), [self.precision(k) for k in range(len(self.members))],
                                  self.mode_weights)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` draws ``(n, d)`` from the mixture ``Σ_k π_k N(w*_k, Λ*_k⁻¹)``."""
        return self.posterior().sample(n, generator)

    def log_prob(self, w: torch.Tensor) -> torch.Tensor:
        """``log Σ_k π_k N(w; w*_k, Λ*_k⁻¹)`` for ``w`` ``(..., d)`` (float64)."""
        return self.posterior().log_prob(w).double()

    def predict(self, x: torch.Tensor | np.ndarray, predictive: str = "map", samples: int = 30, scale: float = 1.0,
                link: str = "probit", seed: int = 0, max_memory: int | str | None = None,
                raw: bool = False) -> torch.Tensor:
        """Class probabilities ``(n, classes)`` for inputs ``x`` (see :mod:`posterior_fusion.predictive`).

        ``x``: inputs as a data file stores them (uint8 pixels ``(n, H, W)``/``(n, C, H, W)`` or
        features ``(n, F)``; numpy or torch, any real dtype): the input transform the clients were
        trained with is applied. ``raw=True``: ``x`` is already the model's input (transformed).
        The GLM predictive's working set stays within ``max_memory``."""
        x = model_inputs(self.model_spec, self.metadata.get("input_transform"), x, raw, self.path)
        if self.curvatures is None:  # point estimates only: the map predictive (others refuse in one line)
            probs = predict(self.model_spec, list(self.members), x, predictive, None, self.mode_weights,
                            samples, scale, link, seed, max_memory, self.pooling)
        else:
            probs = self.posterior().predict(self.model_spec, x, predictive, samples, scale, link, seed, max_memory)
        return checked_probabilities(probs, self.path, self.metadata)

    def models(self) -> list[nn.Module]:
        """One fresh ``nn.Module`` per member (no storage shared between them), in evaluation mode, of the plain
        architecture (:meth:`ModelSpec.architecture`): its ``state_dict`` is complete — a fine-tuned model's frozen
        weights put back, LoRA merged (``W + B A``), a BatchNorm's statistics as buffers — and loads with
        ``strict=True`` into a fresh module of the spec's architecture. They take the **model's inputs** — data
        after the artifact's input transform (``predict(x, raw=True)``'s inputs); :meth:`models_for_raw_inputs`
        takes raw data, as ``predict(x)`` does."""
        return [exported_module(self.model_spec, w) for w in self.members]

    def models_for_raw_inputs(self) -> list[nn.Module]:
        """:meth:`models`, each behind the artifact's input transform (``nn.Sequential(transform, model)``): raw
        pixels or features in, logits out, as ``predict(x)`` takes them."""
        transform = self.metadata.get("input_transform")
        step = InputTransformModule(InputTransform.from_dict(dict(transform), self.path) if transform else None)
        return [nn.Sequential(step, m).eval() for m in self.models()]


def model_inputs(spec: ModelSpec, transform: Mapping[str, Any] | None, x: torch.Tensor | np.ndarray, raw: bool,
                 where: str) -> torch.Tensor:
    """float32 model inputs from ``x`` (numpy or torch, any real dtype): the recorded input
    transform applied unless ``raw``; a shape the model cannot take is refused in one line."""
    if isinstance(x, torch.Tensor) and x.is_meta:
        raise ConfigError(f"{where}: inputs are a meta tensor (a shape without values)")
    try:
        arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{where}: inputs must be a real array (n, ...): {shown(str(exc), 80)}") from None
    if arr.dtype.kind not in "fiub" or arr.ndim < 2:
        raise ConfigError(f"{where}: inputs must be a real array (n, ...), got {arr.dtype} of shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ConfigError(f"{where}: inputs hold no rows (shape {arr.shape})")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        row = int(np.argwhere(~np.isfinite(arr.reshape(arr.shape[0], -1)))[0][0])
        raise ConfigError(f"{where}: inputs hold NaN or Inf (first in row {row})")
    with np.errstate(over="ignore", invalid="ignore"):  # values beyond float32 become Inf: refused just below
        if raw or transform is None:
            out = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        else:
            out = InputTransform.from_dict(dict(transform), where).apply(arr, "inputs")
    if not torch.isfinite(out).all():
        row = int(torch.nonzero(~torch.isfinite(out.reshape(out.shape[0], -1)))[0, 0])
        raise ConfigError(f"{where}: inputs beyond float32's range (first in row {row}, after the input transform)")
    spec.check_input(tuple(out.shape[1:]), f"{where}: inputs")
    spec.check_token_ids(out, f"{where}: inputs")
    return out


def checked_probabilities(probs: torch.Tensor, where: str, metadata: Mapping[str, Any] | None = None) -> torch.Tensor:
    """``probs`` ``(n, classes)`` as they are if every row is finite; else :func:`non_finite_predictive`'s error
    (``metadata``: the global's, which may record a diverged fusion): the API never returns NaN probabilities."""
    bad = ~torch.isfinite(probs).all(dim=-1)
    if bad.any():
        raise non_finite_predictive(where, int(bad.sum()), probs.shape[0], metadata)
    return probs


def non_finite_predictive(where: str, count: int, n: int,
                          metadata: Mapping[str, Any] | None = None) -> NonFiniteOutputError:
    """The one error for a predictive that is not finite on ``count`` of ``n`` input rows: a global whose fusion
    warned that its members lie far from every client MAP (metadata ``far_members``) is a diverged fusion;
    otherwise the inputs are far outside what the models were trained on (their logits overflow)."""
    why = ("a diverged fusion: its members lie far from every client MAP (metadata far_members)"
           if (metadata or {}).get("far_members") else
           "the inputs are far outside what the models were trained on (the logits overflow float32)")
    return NonFiniteOutputError(f"{where}: the predictive is not finite for {count} of {n} input rows: {why}")


def frozen_mapping(obj: dict) -> Mapping[str, Any]:
    return MappingProxyType(dict(obj))
