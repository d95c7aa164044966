"""What every fusion method takes and returns: its inputs (the clients, the shared options, the server's data) and its result (the members, their weights, the pooling)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.curvature import BlockDiag
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.options import FusionOptions
from posterior_fusion.models import ModelSpec
from posterior_fusion.pooling import AVERAGE, Pooling


def prior_precision_of(prior_var: float) -> float:
    """λ0 = 1 / σ0²: the one conversion between the user-facing variance and the stored precision."""
    return 1.0 / prior_var


@dataclass
class FusionInputs:
    """What a method gets: validated clients, shared options, optional server data."""

    clients: list[ClientPosterior]
    options: FusionOptions = field(default_factory=FusionOptions)
    val: SiloData | None = None
    unlabeled: SiloData | None = None
    reload: Callable[[ClientPosterior], ClientPosterior] | None = None
    """Where the clients were loaded without their curvature for a method that folds them one at a time (its
    :class:`~posterior_fusion.fusion.client_sums.ClientSums`): one client read again with it."""

    @property
    def spec(self) -> ModelSpec:
        return self.clients[0].model_spec

    def temperature(self, c: ClientPosterior) -> float:
        return self.options.temperature if self.options.temperature is not None else c.temperature

    def prior_precision(self, c: ClientPosterior) -> float:
        return prior_precision_of(self.options.prior_var) if self.options.prior_var is not None else c.prior_precision

    def server_prior_precision(self) -> float:
        """λ0 of the global prior: the override, else the median of the clients' λ0."""
        if self.options.prior_var is not None:
            return prior_precision_of(self.options.prior_var)
        vals = sorted(c.prior_precision for c in self.clients)
        return vals[len(vals) // 2]

    def prior_mean(self) -> torch.Tensor | None:
        """The centre of the clients' shared prior ``N(μ0, λ0⁻¹ I)``, ``(d,)`` float64: the pretrained base they
        fine-tuned, or ``None`` for zero (random starting points); :func:`check_compatible` made them equal."""
        mean = self.clients[0].prior_mean
        return None if mean is None else mean.double()

    def mode_maps(self, m: int | None = None) -> torch.Tensor:
        """MAP of component ``m`` (default ``options.component``) of every client, ``(C, d)``."""
        m = self.options.component if m is None else m
        for c in self.clients:
            if m >= c.num_components:
                raise ConfigError(f"{c.path}: has {c.num_components} components, component {m} requested")
        return torch.stack([c.components[m].map.float() for c in self.clients])

    def n_weights(self) -> torch.Tensor:
        n = torch.tensor([c.n_data for c in self.clients], dtype=torch.float32)
        return n / n.sum()


@dataclass
class FusionResult:
    """Ensemble members (independent ``(d,)`` tensors) plus method-specific information."""

    members: list[torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)
    curvatures: list[BlockDiag] | None = None  # raw Laplace curvature per member (precision = curvature + λ0 I)
    spec: ModelSpec | None = None  # the members' model where it is not the clients' (a distilled student's)

    # info fields indexed by member: how the members' predictions combine and where they came from (they go
    # with the members)
    COMBINATION_KEYS = ("mode_weights", "pooling", "members_from_starts")

    @property
    def mode_weights(self) -> torch.Tensor | None:
        """The mixture weights π ``(K,)`` the method stored, else ``None`` (uniform)."""
        w = self.info.get("mode_weights")
        return None if w is None else torch.tensor(w, dtype=torch.float64)

    def pooling(self, num_classes: int) -> Pooling:
        """How the members' predictions combine (:mod:`posterior_fusion.pooling`)."""
        raw = self.info.get("pooling")
        return AVERAGE if raw is None else Pooling.from_metadata(raw, len(self.members), num_classes)

    def distilled(self, w: torch.Tensor, record: dict[str, Any], spec: ModelSpec | None = None) -> FusionResult:
        """The result once its members are distilled into the one model ``w`` ``(d,)`` (of ``spec`` where it is not
        the clients' model): the members' combination fields leave with them, the distillation ``record`` is added."""
        info = {k: v for k, v in self.info.items() if k not in self.COMBINATION_KEYS}
        return FusionResult([w], {**info, "distill": record}, spec=spec)

    def model_spec(self, inputs: FusionInputs) -> ModelSpec:
        """The members' model: :attr:`spec`, else the clients'."""
        return self.spec or inputs.spec
