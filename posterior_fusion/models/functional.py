"""Evaluate many flat weight vectors of one architecture without building a model per vector."""

from __future__ import annotations

import math

import torch
from torch.func import functional_call

from posterior_fusion.models import ModelSpec
from posterior_fusion.models.maxpool import fast_max_pooling


def batched_logits(spec: ModelSpec, W: torch.Tensor, x: torch.Tensor, batch_size: int = 2048) -> torch.Tensor:
    """Logits of K flat weight vectors ``W`` ``(K, d)`` on ``x`` ``(n, ...)``: ``(K, n, classes)``, the model in
    evaluation mode (dropout off, BatchNorm on its stored statistics)."""
    model = spec.build().eval()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [math.prod(s) for s in shapes]
    outs = []
    with torch.no_grad(), fast_max_pooling(model):
        for w in W:
            params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(w.float(), sizes), shapes)}
            outs.append(torch.cat([functional_call(model, params, (x[i : i + batch_size],))
                                   for i in range(0, x.shape[0], batch_size)]))
    return torch.stack(outs)
