"""Methods that read the clients only through sums over them (:class:`ClientSums`): what a secure aggregation computes without the server seeing any one client."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posterior_fusion.errors import IncompatibleArtifactsError
from posterior_fusion.fusion.types import FusionInputs, FusionResult
from posterior_fusion.models import ModelSpec


@dataclass(frozen=True)
class SumsContext:
    """What a server that holds only sums over clients knows besides them: the model, how many clients and samples
    the sums cover, and the global prior ``N(prior_mean, prior_precision⁻¹ I)`` (``prior_mean`` ``(d,)`` float64, or
    ``None`` for zero)."""

    spec: ModelSpec
    clients: int
    n_data: int
    prior_precision: float
    prior_mean: torch.Tensor | None = None


@dataclass(frozen=True)
class ClientSums:
    """A method whose server step reads the clients only through sums ``Σ_c s_c`` of per-client statistics, so a
    secure aggregation can compute it without the server seeing any one client's ``s_c``.

    ``local(inputs, settings)``: the statistics ``s_c`` of the one client in ``inputs``, a list of float64 tensors
    (their shapes depend on the model only); ``finish(sums, context, settings)``: the result from the element-wise
    sums of those lists over the clients; ``structures``: the curvature structures ``local`` accepts (None: all).
    The method's own ``run`` is :meth:`run`, ``finish`` over the sums of ``local``, so the two paths are one
    computation."""

    local: Callable[[FusionInputs, Any], list[torch.Tensor]]
    finish: Callable[[list[torch.Tensor], SumsContext, Any], FusionResult]
    structures: tuple[str, ...] | None = None

    def run(self, inputs: FusionInputs, settings: Any) -> FusionResult:
        """The method on clients that are all at hand: ``finish`` over :func:`sum_over_clients`."""
        return self.finish(sum_over_clients(inputs, self, settings), sums_context(inputs), settings)


def sum_over_clients(inputs: FusionInputs, sums: ClientSums, settings: Any) -> list[torch.Tensor]:
    """``[Σ_c s_c]``: each client's statistics (``sums.local`` on that client alone) summed element-wise; where the
    clients came without their curvature (``inputs.reload``), each is read again with it, one at a time."""
    total: list[torch.Tensor] | None = None
    for c in inputs.clients:
        one = inputs.reload(c) if inputs.reload is not None else c
        s = sums.local(FusionInputs([one], inputs.options, inputs.val, inputs.unlabeled), settings)
        del one
        total = s if total is None else [a + b for a, b in zip(total, s, strict=True)]
    if total is None:
        raise IncompatibleArtifactsError("no client artifacts given")
    return total


def sums_context(inputs: FusionInputs) -> SumsContext:
    """The :class:`SumsContext` of clients that are all at hand."""
    return SumsContext(inputs.spec, len(inputs.clients), sum(c.n_data for c in inputs.clients),
                       inputs.server_prior_precision(), inputs.prior_mean())
