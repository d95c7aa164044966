"""FedAvg (one shot): the n-weighted mean of the clients' MAPs.

Unimodal methods use component ``options.component`` (default 0) of every client: those
components share their starting point across clients (shared init), as one-shot FedAvg needs.
Its server step is a ratio of two sums over clients (``Σ_c n_c ŵ_c`` and ``Σ_c n_c``): :data:`SUMS`.
"""

from __future__ import annotations

import torch

from posterior_fusion.fusion.client_sums import ClientSums, SumsContext
from posterior_fusion.fusion.method_type import FusionMethod, never
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionResult


def fedavg_local(inputs: FusionInputs, settings: MethodSettings) -> list[torch.Tensor]:
    """The one client's ``[n_c ŵ_c (d,), n_c (1,)]``, float64."""
    c = inputs.clients[0]
    n = torch.tensor([float(c.n_data)], dtype=torch.float64)
    return [n * inputs.mode_maps()[0].double(), n]


def fedavg_finish(sums: list[torch.Tensor], context: SumsContext, settings: MethodSettings) -> FusionResult:
    return FusionResult([(sums[0] / sums[1]).float()])


SUMS = ClientSums(fedavg_local, fedavg_finish)


def fedavg_weights(inputs: FusionInputs) -> torch.Tensor:
    """``(d,)``: Σ_c (n_c / n) ŵ_c of the chosen component."""
    return SUMS.run(inputs, MethodSettings()).members[0]


METHOD = FusionMethod("fedavg", SUMS.run, MethodSettings, "n-weighted mean of the client MAPs", sums=SUMS,
                      uses_curvature=never)
