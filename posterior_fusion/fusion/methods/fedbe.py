"""FedBE (Chen & Chao, ``000``/``004``): a global distribution over the client models — an
n-weighted diagonal Gaussian (eq. 5) or Dirichlet combinations Σ γ_i w_i, γ ~ Dir(α·1) (eq. 7) —
whose ensemble {mean} ∪ clients ∪ S samples is, with unlabeled server data, distilled into one
model with FedBE's SWA schedule and sharpened pseudo-labels (:mod:`posterior_fusion.fusion.distill`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from posterior_fusion import ranges
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.distill import DistillConfig, distill
from posterior_fusion.fusion.method_type import FusionMethod, never
from posterior_fusion.fusion.settings_parsing import MethodSettings, setting
from posterior_fusion.fusion.types import FusionInputs, FusionResult


@dataclass(frozen=True)
class FedBESettings(MethodSettings):
    num_samples: int = setting(10, "Samples S drawn from the global distribution over client models.", bounds=(0, 1_000_000))
    dirichlet: float = setting(0.0, "0: the Gaussian of eq. 5; > 0: samples Σ γ_i w_i with γ ~ Dir(dirichlet·1) (eq. 7).", bounds=(0, 1e6))
    distill_epochs: int = setting(20, "Distillation epochs (only with unlabeled server data; FedBE: 20).", bounds=ranges.EPOCHS)
    sharpen: float = setting(2.0, "Pseudo-label sharpening power p^s / Σ p^s (FedBE: 2; 1 = none).", bounds=(1e-3, 1e3))

    def validate(self) -> None:
        super().validate()
        if self.num_samples < 0 or self.distill_epochs < 0 or self.dirichlet < 0 or not self.sharpen > 0:
            raise ConfigError("fedbe settings need num_samples, distill_epochs, dirichlet >= 0 and sharpen > 0")


def fedbe(inputs: FusionInputs, settings: FedBESettings) -> FusionResult:
    W = inputs.mode_maps()
    p = inputs.n_weights()[:, None]
    mean = (p * W).sum(0)
    gen = torch.Generator().manual_seed(inputs.options.sampling_seed)
    if settings.dirichlet > 0:
        conc = torch.full((settings.num_samples, W.shape[0]), float(settings.dirichlet))
        gammas = torch._standard_gamma(conc, generator=gen)  # Dir(α·1) = normalised Gamma(α) draws
        samples = (gammas / gammas.sum(1, keepdim=True)) @ W
    else:
        var = (p * (W - mean).square()).sum(0)
        samples = mean + var.sqrt() * torch.randn(settings.num_samples, mean.numel(), generator=gen)
    members = [mean] + list(W) + list(samples)
    info = {"num_samples": settings.num_samples, "distribution": "dirichlet" if settings.dirichlet > 0 else "gaussian"}
    if inputs.unlabeled is None:
        return FusionResult([w.clone() for w in members], info)
    cfg = replace(DistillConfig(), epochs=settings.distill_epochs, sharpen=settings.sharpen)
    w, record = distill(inputs.spec, torch.stack(members), mean, inputs.unlabeled.inputs(), cfg, gen,
                        inputs.options.progress)
    return FusionResult([w], {**info, "distilled_from": len(members), "distill": record})


METHOD = FusionMethod("fedbe", fedbe, FedBESettings,
                      "FedBE: Gaussian or Dirichlet distribution over client models, sampled ensemble, distilled",
                      members=lambda settings, size: 1 + size.clients + settings.num_samples, distils=True,
                      uses_curvature=never)
