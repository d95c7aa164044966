"""K-FAC's output factor ``B`` of a layer (the Gram of its back-propagated output gradients) and
the per-sample weight and bias gradients the diagonal GGN squares."""

from __future__ import annotations

import torch
from torch import nn

from posterior_fusion.local.capture import gram
from posterior_fusion.models.layers import LOW_DTYPES, widened


def reduced_grad(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """K-FAC-reduce's output gradient per sample ``(M, O)``: summed over the shared positions."""
    if isinstance(module, nn.Conv2d):
        return g.sum((2, 3))
    return g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)


def grad_columns(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """Output gradient ``(M, O, ...)`` (conv) or ``(M, ..., O)`` (linear) as columns ``(O, M·S)``."""
    if isinstance(module, nn.Conv2d):
        return g.transpose(0, 1).reshape(g.shape[1], -1)
    return g.reshape(-1, g.shape[-1]).T


def per_sample_grads(module: nn.Module, patches: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample weight and bias gradients ``(M, O, I)``, ``(M, O)`` of one back-propagated column,
    from the input ``patches`` ``(M, I, S)`` and the output gradient."""
    M = patches.shape[0]
    g3 = g.reshape(M, g.shape[1], -1) if isinstance(module, nn.Conv2d) else g.reshape(M, -1, g.shape[-1]).transpose(1, 2)
    return g3 @ patches.transpose(1, 2), g3.sum(2)


WIDEN_SAMPLES = 16  # samples widened at once by :func:`output_gram` (the widened copy stays in cache)


def output_gram(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """``Σ`` over samples and positions of ``g gᵀ`` ``(O, O)`` in float64, for a layer's output gradient
    (conv ``(M, O, H, W)``, linear ``(M, ..., O)``). A convolution with at most :data:`CHUNK_COLUMNS`
    positions and no more channels than positions takes one batched product per sample straight
    from ``g``'s memory (float32 over one sample's positions, float64 over samples): no transposed
    copy of ``g`` (faster than the column chunks there: ``docs/benchmarks.md``, "Capture")."""
    if isinstance(module, nn.Conv2d):
        g3 = g.reshape(g.shape[0], g.shape[1], -1)  # (M, O, S)
        if g3.shape[1] <= g3.shape[2] <= gram.CHUNK_COLUMNS:
            if g3.dtype not in LOW_DTYPES:
                return torch.bmm(g3, g3.transpose(1, 2)).sum(0, dtype=torch.float64)
            out = 0
            for i in range(0, g3.shape[0], WIDEN_SAMPLES):
                c = widened(g3[i: i + WIDEN_SAMPLES])
                out = out + torch.bmm(c, c.transpose(1, 2)).sum(0, dtype=torch.float64)
            return out
    return gram.float64_gram(grad_columns(module, g))
