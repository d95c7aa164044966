"""Fisher merging (Matena & Raffel): Σ_c diag(G_c) ŵ_c / Σ_c diag(G_c), FedAvg where Σ_c diag(G_c) ≈ 0.

Uses the diagonal of whatever curvature the clients stored (diag, or the diagonal of K-FAC /
the full block).
"""

from __future__ import annotations

import torch

from posterior_fusion.fusion.methods.fedavg import fedavg_weights
from posterior_fusion.fusion.settings import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionMethod, FusionResult


def fisher_merge(inputs: FusionInputs, settings: MethodSettings) -> FusionResult:
    m = inputs.options.component
    W = inputs.mode_maps()
    F = torch.stack([c.components[m].curvature.diagonal().float() for c in inputs.clients])
    num, den = (F * W).sum(0), F.sum(0)
    tiny = den <= 1e-12 * den.max().clamp_min(1e-30)
    merged = torch.where(tiny, fedavg_weights(inputs), num / den.clamp_min(1e-30))
    return FusionResult([merged], {"fedavg_fallback_params": int(tiny.sum())})


METHOD = FusionMethod("fisher-merge", fisher_merge, MethodSettings, "diagonal-Fisher-weighted average of MAPs")
