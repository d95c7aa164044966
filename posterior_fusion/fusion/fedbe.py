"""FedBE (Chen & Chao): an n-weighted diagonal Gaussian over the client models; the ensemble
{mean} ∪ clients ∪ S samples, optionally distilled into one model on unlabeled server data."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.common import FusionInputs, FusionMethod, FusionResult
from posterior_fusion.fusion.settings import MethodSettings, setting
from posterior_fusion.models.functional import batched_logits
from posterior_fusion.progress import progress


@dataclass(frozen=True)
class FedBESettings(MethodSettings):
    num_samples: int = setting(10, "Samples S drawn from the Gaussian over client models.")
    distill_epochs: int = setting(5, "Distillation epochs (only with unlabeled server data).")

    def validate(self) -> None:
        if self.num_samples < 0 or self.distill_epochs < 0:
            raise ConfigError("settings num_samples and distill_epochs must be >= 0")


def fedbe(inputs: FusionInputs, settings: FedBESettings) -> FusionResult:
    W = inputs.mode_maps()
    p = inputs.n_weights()[:, None]
    mean = (p * W).sum(0)
    var = (p * (W - mean).square()).sum(0)
    gen = torch.Generator().manual_seed(inputs.options.sampling_seed)
    samples = mean + var.sqrt() * torch.randn(settings.num_samples, mean.numel(), generator=gen)
    members = [mean] + list(W) + list(samples)
    if inputs.unlabeled is None:
        return FusionResult([w.clone() for w in members], {"num_samples": settings.num_samples})
    return FusionResult([distill(inputs, torch.stack(members), mean, gen, settings.distill_epochs)],
                        {"distilled_from": len(members)})


def distill(inputs: FusionInputs, teachers: torch.Tensor, start: torch.Tensor, gen: torch.Generator, epochs: int,
            lr: float = 1e-3, batch_size: int = 64) -> torch.Tensor:
    """Distil the teachers' averaged softmax on the unlabeled data into one SWA model."""
    x = inputs.unlabeled.inputs()
    targets = torch.softmax(batched_logits(inputs.spec, teachers, x), -1).mean(0)  # (n, classes)
    model = inputs.spec.build()
    vector_to_parameters(start.clone(), model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    swa, count = None, 0
    for _ in progress(range(epochs), "fedbe distill", show=inputs.options.progress):
        perm = torch.randperm(x.shape[0], generator=gen)
        for i in range(0, x.shape[0], batch_size):
            idx = perm[i : i + batch_size]
            loss = -(targets[idx] * torch.log_softmax(model(x[idx]), -1)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        w = parameters_to_vector(model.parameters()).detach()
        count += 1
        swa = w.clone() if swa is None else swa + (w - swa) / count
    return start.clone() if swa is None else swa


METHOD = FusionMethod("fedbe", fedbe, FedBESettings, "Gaussian over client models, sampled ensemble (FedBE)")
