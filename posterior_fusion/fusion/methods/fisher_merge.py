"""Fisher merging (Matena & Raffel): Σ_c diag(G_c) ŵ_c / Σ_c diag(G_c), FedAvg where Σ_c diag(G_c) ≈ 0.

Uses the diagonal of whatever curvature the clients stored (diag, or the diagonal of K-FAC /
the full block). Its server step reads four sums over clients (:data:`SUMS`).
"""

from __future__ import annotations

import torch

from posterior_fusion.fusion.client_sums import ClientSums, SumsContext
from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.methods.fedavg import fedavg_local
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionResult


def fisher_merge_local(inputs: FusionInputs, settings: MethodSettings) -> list[torch.Tensor]:
    """The one client's ``[diag(G_c) ⊙ ŵ_c, diag(G_c), n_c ŵ_c, n_c]`` (``(d,)`` each, ``n_c`` ``(1,)``), float64."""
    w = inputs.mode_maps()[0].double()  # checks the component exists
    F = inputs.clients[0].components[inputs.options.component].curvature.diagonal().double()
    return [F * w, F, *fedavg_local(inputs, settings)]


def fisher_merge_finish(sums: list[torch.Tensor], context: SumsContext, settings: MethodSettings) -> FusionResult:
    num, den, fedavg = sums[0], sums[1], sums[2] / sums[3]
    tiny = den <= 1e-12 * den.max().clamp_min(1e-30)
    merged = torch.where(tiny, fedavg, num / den.clamp_min(1e-30))
    return FusionResult([merged.float()], {"fedavg_fallback_params": int(tiny.sum())})


SUMS = ClientSums(fisher_merge_local, fisher_merge_finish)


METHOD = FusionMethod("fisher-merge", SUMS.run, MethodSettings, "diagonal-Fisher-weighted average of MAPs",
                      sums=SUMS)
