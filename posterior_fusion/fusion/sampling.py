"""Sampling-based baselines: FedBE (Chen & Chao) and a SWAG ensemble."""

from __future__ import annotations

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from tqdm.auto import tqdm

from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion.common import FusionInputs, FusionResult, batched_logits


def fedbe(inputs: FusionInputs) -> FusionResult:
    """n-weighted diagonal Gaussian over client models; ensemble {mean} ∪ clients ∪ S samples.

    With unlabeled server data, the ensemble is distilled into one model (soft labels, SGD
    with stochastic weight averaging over the epochs' ends), which becomes the only member.
    """
    opts = inputs.options
    W = inputs.mode_maps()
    p = inputs.n_weights()[:, None]
    mean = (p * W).sum(0)
    var = (p * (W - mean).square()).sum(0)
    gen = torch.Generator().manual_seed(opts.seed)
    samples = mean + var.sqrt() * torch.randn(opts.num_samples, mean.numel(), generator=gen)
    members = [mean] + list(W) + list(samples)
    if inputs.unlabeled is None:
        return FusionResult([w.clone() for w in members], {"num_samples": opts.num_samples})
    return FusionResult([distill(inputs, torch.stack(members), mean, gen)], {"distilled_from": len(members)})


def distill(inputs: FusionInputs, teachers: torch.Tensor, start: torch.Tensor, gen: torch.Generator,
            lr: float = 1e-3, batch_size: int = 64) -> torch.Tensor:
    """Distil the teachers' averaged softmax on the unlabeled data into one SWA model."""
    x, _ = inputs.unlabeled.tensors()
    targets = torch.softmax(batched_logits(inputs.spec, teachers, x), -1).mean(0)  # (n, classes)
    model = inputs.spec.build()
    vector_to_parameters(start.clone(), model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    swa, count = None, 0
    for _ in tqdm(range(inputs.options.distill_epochs), desc="fedbe distill", leave=False,
                  disable=None if inputs.options.progress else True):
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


def swag_ensemble(inputs: FusionInputs) -> FusionResult:
    """``num_samples`` draws from every client component's SWAG Gaussian, as one ensemble."""
    gen = torch.Generator().manual_seed(inputs.options.seed)
    members = []
    for c in inputs.clients:
        for comp in c.components:
            if comp.swag is None:
                raise MethodNotApplicableError(f"method 'swag' needs SWAG moments; {c.path} component {comp.index} has none (fit-local --swag)")
            members.extend(comp.swag.sample(max(1, inputs.options.num_samples), gen).float())
    return FusionResult([w.clone() for w in members])
