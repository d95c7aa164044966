"""Types and checks shared by all fusion methods."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError, IncompatibleArtifactsError, MethodNotApplicableError
from posterior_fusion.models import ModelSpec


@dataclass(frozen=True)
class FusionOptions:
    """Server hyper-parameters (paper defaults). ``None`` temperature / prior_var: the clients' values."""

    steps: int = 300
    lr: float = 1e-3
    clip: float = 1.0
    val_every: int = 30
    temperature: float | None = None
    prior_var: float | None = None
    modes: int | None = None
    seed: int = 0
    mode_index: int = 0          # which client component the unimodal baselines use
    num_samples: int = 10        # fedbe / swag samples
    regmean_alpha: float = 1.0   # scale of off-diagonal Gram entries (RegMean's α)
    distill_epochs: int = 5      # fedbe distillation
    lowrank_tol: float = 0.0     # Kronecker low-rank shortcut (0 = exact)
    kernel: str | None = None    # "torch" | "triton" | None (auto)
    device: str = "cpu"          # where fedbens/fedfisher optimise ("cuda" uses the Triton kernels)
    progress: bool = True

    def validate(self) -> None:
        if self.steps < 0 or self.lr <= 0 or self.clip <= 0 or self.val_every < 1:
            raise ConfigError("--steps >= 0, --lr > 0, --clip > 0 and --val-every >= 1 are required")
        if self.temperature is not None and not self.temperature > 0:
            raise ConfigError("--temperature must be > 0")
        if self.prior_var is not None and not self.prior_var > 0:
            raise ConfigError("--prior-var must be > 0")
        if self.modes is not None and self.modes < 1:
            raise ConfigError("--modes must be >= 1")
        if not 0 <= self.lowrank_tol < 1:
            raise ConfigError("--lowrank-tol must be in [0, 1)")
        if self.device not in ("cpu", "cuda") or (self.device == "cuda" and not torch.cuda.is_available()):
            raise ConfigError(f"--device {self.device!r} is not available here (cpu, or cuda with a GPU)")
        if self.num_samples < 0 or self.distill_epochs < 0 or not 0 <= self.regmean_alpha <= 1:
            raise ConfigError("--num-samples >= 0, --distill-epochs >= 0, 0 <= --regmean-alpha <= 1 are required")


@dataclass
class FusionInputs:
    """What a method gets: validated clients, options, optional server data."""

    clients: list[ClientPosterior]
    options: FusionOptions
    val: SiloData | None = None
    unlabeled: SiloData | None = None

    @property
    def spec(self) -> ModelSpec:
        return self.clients[0].model_spec

    def temperature(self, c: ClientPosterior) -> float:
        return self.options.temperature if self.options.temperature is not None else c.temperature

    def prior_precision(self, c: ClientPosterior) -> float:
        return 1.0 / self.options.prior_var if self.options.prior_var is not None else c.prior_precision

    def server_prior_precision(self) -> float:
        """λ0 of the global prior: the override, else the median of the clients' λ0."""
        if self.options.prior_var is not None:
            return 1.0 / self.options.prior_var
        vals = sorted(c.prior_precision for c in self.clients)
        return vals[len(vals) // 2]

    def mode_maps(self, m: int | None = None) -> torch.Tensor:
        """MAP of component ``m`` (default ``mode_index``) of every client, ``(C, d)``."""
        m = self.options.mode_index if m is None else m
        for c in self.clients:
            if m >= c.num_components:
                raise ConfigError(f"{c.path}: has {c.num_components} components, mode index {m} requested")
        return torch.stack([c.components[m].map.float() for c in self.clients])

    def n_weights(self) -> torch.Tensor:
        n = torch.tensor([c.n_data for c in self.clients], dtype=torch.float32)
        return n / n.sum()


@dataclass
class FusionResult:
    """Ensemble members (independent ``(d,)`` tensors) plus method-specific information."""

    members: list[torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)


FusionMethod = Callable[[FusionInputs], FusionResult]


def check_compatible(clients: list[ClientPosterior]) -> None:
    """Refuse sets that cannot be fused, naming the first offending file."""
    if not clients:
        raise IncompatibleArtifactsError("no client artifacts given")
    ref = clients[0]
    for c in clients[1:]:
        if c.model_spec != ref.model_spec:
            raise IncompatibleArtifactsError(f"{c.path}: model {c.model_spec.to_json()} differs from {ref.path}'s {ref.model_spec.to_json()}")
        if c.layout != ref.layout:
            raise IncompatibleArtifactsError(f"{c.path}: parameter layout differs from {ref.path}")
    shas = {}
    for c in clients:
        if c.sha256 in shas:
            raise IncompatibleArtifactsError(f"{c.path}: same content as {shas[c.sha256]} (a client given twice?)")
        shas[c.sha256] = c.path


def require_structures(inputs: FusionInputs, allowed: tuple[str, ...], method: str, hint: str = "") -> None:
    for c in inputs.clients:
        if c.structure not in allowed:
            raise MethodNotApplicableError(
                f"method {method!r} needs curvature structure {' or '.join(allowed)}; {c.path} has {c.structure!r}{hint}")


def require_equal_components(inputs: FusionInputs, method: str) -> int:
    ms = {c.num_components for c in inputs.clients}
    if len(ms) != 1:
        detail = ", ".join(f"{c.path}: M={c.num_components}" for c in inputs.clients)
        raise IncompatibleArtifactsError(f"method {method!r} needs the same number of mixtures on every client ({detail})")
    return ms.pop()


def batched_logits(spec: ModelSpec, W: torch.Tensor, x: torch.Tensor, batch_size: int = 2048) -> torch.Tensor:
    """Logits of K flat weight vectors ``W`` ``(K, d)`` on ``x`` ``(n, ...)``: ``(K, n, classes)``."""
    model = spec.build()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [math.prod(s) for s in shapes]
    outs = []
    with torch.no_grad():
        for w in W:
            params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(w.float(), sizes), shapes)}
            outs.append(torch.cat([functional_call(model, params, (x[i : i + batch_size],))
                                   for i in range(0, x.shape[0], batch_size)]))
    return torch.stack(outs)


def accuracy_of(spec: ModelSpec, W: torch.Tensor, data: SiloData) -> torch.Tensor:
    """Accuracy of each of the K weight vectors on ``data``: ``(K,)``."""
    x, y = data.tensors()
    return (batched_logits(spec, W, x).argmax(-1) == y).float().mean(-1)
