"""RegMean (Jin et al.) from the K-FAC input factors: for each weight ``(out, in)``

    W* = (Σ_c W_c G_c)(Σ_c G_c)⁻¹ ,   G_c = n_c · A_c  (A_c = mean of x xᵀ on client c)

with RegMean's α scaling the off-diagonal Gram entries; other parameters are n-averaged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.common import FusionInputs, FusionMethod, FusionResult, require_structures
from posterior_fusion.fusion.fedavg import fedavg_weights
from posterior_fusion.fusion.settings import MethodSettings, setting


@dataclass(frozen=True)
class RegMeanSettings(MethodSettings):
    alpha: float = setting(1.0, "Scale of the off-diagonal Gram entries (RegMean's α), in [0, 1].")

    def validate(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ConfigError("setting alpha must be in [0, 1]")


def regmean(inputs: FusionInputs, settings: RegMeanSettings) -> FusionResult:
    require_structures(inputs, ("kron",), "regmean", " (it needs the K-FAC input factors)")
    m = inputs.options.component
    out = fedavg_weights(inputs).clone()
    ref = inputs.clients[0].components[m].curvature
    for j, (block, off) in enumerate(zip(ref.blocks, ref.offsets)):
        if block.kind != "kron":
            continue
        shape = block.shape
        num = torch.zeros(shape, dtype=torch.float64)
        den = torch.zeros(shape[1], shape[1], dtype=torch.float64)
        for c in inputs.clients:
            comp = c.components[m]
            A = comp.curvature.blocks[j].A.double() * c.n_data
            A = settings.alpha * A + (1 - settings.alpha) * torch.diag(torch.diagonal(A))
            W = comp.map[off : off + block.dim].double().reshape(shape)
            num += W @ A
            den += A
        den += 1e-8 * torch.diagonal(den).mean().clamp_min(1e-30) * torch.eye(shape[1], dtype=torch.float64)
        merged = torch.linalg.solve(den, num.T).T  # den is symmetric: (num den⁻¹)ᵀ = den⁻¹ numᵀ
        out[off : off + block.dim] = merged.reshape(-1).float()
    return FusionResult([out])


METHOD = FusionMethod("regmean", regmean, RegMeanSettings, "Gram-weighted merge of linear layers from K-FAC input factors")
