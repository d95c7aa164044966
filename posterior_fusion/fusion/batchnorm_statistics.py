"""The fused model's BatchNorm statistics (``batchnorm_statistics``) when the clients trained BatchNorm from
random starting points and folded their statistics into the affine parameters (:mod:`posterior_fusion.models.batchnorm`):
``fold`` keeps the fused affine maps as the method fused them; ``reset`` estimates the statistics again on the
server's inputs (RESET, Jordan et al. 2023)."""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.types import FusionInputs, FusionResult
from posterior_fusion.models.batchnorm import batch_norms, pooled_statistics, reset_statistics

RESET_BATCH = 256  # inputs per pass of the statistics' estimate


def check_batchnorm_statistics(inputs: FusionInputs) -> None:
    """``reset`` needs clients whose components carry folded statistics: one :class:`ConfigError` line otherwise."""
    missing = [c.path for c in inputs.clients if any(comp.statistics is None for comp in c.components)]
    if missing:
        raise ConfigError(f"{missing[0]}: `batchnorm_statistics` reset applies to clients that trained BatchNorm "
                          "from random starting points (fit-local `batchnorm` fold); this artifact carries no "
                          "folded statistics")


def client_statistics(inputs: FusionInputs) -> torch.Tensor:
    """The clients' pooled statistics ``(2 S,)``: the mixture of every component's population, each client
    weighted by its ``n``, its components equally."""
    stats, weights = [], []
    for c in inputs.clients:
        for comp in c.components:
            stats.append(comp.statistics)
            weights.append(c.n_data / c.num_components)
    model = inputs.spec.build()
    return pooled_statistics(stats, weights, [m.num_features for _, m in batch_norms(model)])


def reset_members(inputs: FusionInputs, result: FusionResult, x: torch.Tensor, log=lambda msg: None) -> dict:
    """Every member of ``result`` with its BatchNorm statistics estimated again on ``x`` ``(n, ...)`` (the model's
    inputs), in place: a member equal to a client's component is read back under that component's own
    statistics, any other under :func:`client_statistics`. Returns the record for the global's metadata."""
    check_batchnorm_statistics(inputs)
    pooled = client_statistics(inputs)
    own = [(comp.map, comp.statistics) for c in inputs.clients for comp in c.components]
    log(f"batchnorm_statistics reset: {len(result.members)} member(s) on {x.shape[0]} server inputs")
    members, matched = [], 0
    for w in result.members:
        target = next((s for m, s in own if m.shape == w.shape and torch.equal(m, w.to(m.dtype))), None)
        matched += target is not None
        model = inputs.spec.build()
        vector_to_parameters(w.detach().clone().float(), model.parameters())
        reset_statistics(model, pooled if target is None else target, x, RESET_BATCH)
        members.append(parameters_to_vector(model.parameters()).detach().to(w.dtype).clone())
    result.members = members
    return {"rule": "reset", "n": int(x.shape[0]), "members_under_own_statistics": matched}
