"""FedAvg (one shot): the n-weighted mean of the clients' MAPs.

Unimodal methods use component ``options.component`` (default 0) of every client: those
components share their starting point across clients (shared init), as one-shot FedAvg needs.
"""

from __future__ import annotations

import torch

from posterior_fusion.fusion.settings import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionMethod, FusionResult


def fedavg_weights(inputs: FusionInputs) -> torch.Tensor:
    """``(d,)``: Σ_c (n_c / n) ŵ_c of the chosen component."""
    return (inputs.n_weights()[:, None] * inputs.mode_maps()).sum(0)


def fedavg(inputs: FusionInputs, settings: MethodSettings) -> FusionResult:
    return FusionResult([fedavg_weights(inputs)])


METHOD = FusionMethod("fedavg", fedavg, MethodSettings, "n-weighted mean of the client MAPs")
