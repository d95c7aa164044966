"""BatchNorm trained from random starting points: statistics folded into the affine parameters.

In evaluation mode a BatchNorm is a per-channel affine map, ``y = γ (x − μ) / √(σ² + ε) + β``. A silo trains
with batch statistics as usual; at the end its statistics ``(μ, σ²)`` are estimated on its data with the
final weights (one pass, every BatchNorm in training mode with a cumulative average as
``torch.optim.swa_utils.update_bn`` does, but every other module in evaluation mode — dropout off, as the
model is evaluated, where ``update_bn`` leaves the whole model in training mode) and **folded** into the affine parameters,

    γ' = γ √(1 + ε) / √(σ² + ε),    β' = β − γ μ / √(σ² + ε),

so that the same layer with the statistics ``(0, 1)`` — frozen (:mod:`.finetune`), identical in every silo
and every model built from the spec — computes the same function. Everything downstream (curvature,
fusion, predictives, Flower) then sees ordinary parameters; the folded statistics are stored per
component (``statistics``, ``(2 S,)``: each BatchNorm's ``μ`` then ``σ²``, in :func:`statistics_names`
order) for the server's ``reset`` rule:

- ``fold`` (the fused model as fused): the fused affine maps are the fusion of the clients' folded maps — the
  "average statistics" rule, since read back as ``(γ, β)`` under the clients' pooled statistics and kept with
  them a member computes this same function;
- ``reset`` (RESET, Jordan et al. 2023, "REPAIR"): each fused member's BatchNorm is read back as
  ``(γ, β)`` under the clients' statistics (a member equal to a client's component under that
  component's own, any other under the clients' pooled statistics, each client weighted by its ``n``),
  then its statistics are estimated again on the server's inputs (the same one pass) and folded in again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from posterior_fusion.errors import ModelSpecError
from posterior_fusion.models.finetune import (
    BATCH_NORMS,
    FrozenBatchNorm1d,
    FrozenBatchNorm2d,
)

__all__ = ["batch_norms", "fold_statistics", "pooled_statistics", "reset_statistics", "thaw"]


def batch_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every BatchNorm with running statistics, in module order (the order of
    :func:`statistics_names` and of a ``statistics`` vector)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, BATCH_NORMS) and m.track_running_stats]


def check_foldable(model: nn.Module, where: str) -> None:
    """One :class:`ModelSpecError` line for a BatchNorm that cannot be folded (no affine parameters)."""
    for name, module in batch_norms(model):
        if not module.affine:
            raise ModelSpecError(f"{where}: BatchNorm {name!r} has no affine parameters (affine=False), so its "
                                 "statistics cannot be folded into them; use affine=True")


def thaw(model: nn.Module) -> nn.Module:
    """Every frozen BatchNorm of ``model`` an ordinary one again, in place: it trains with batch statistics and
    keeps running ones (reset to ``(0, 1)``, momentum as built). Undone by :func:`fold_statistics`."""
    for _, module in batch_norms(model):
        if isinstance(module, (FrozenBatchNorm1d, FrozenBatchNorm2d)):
            module.__class__ = nn.BatchNorm1d if isinstance(module, FrozenBatchNorm1d) else nn.BatchNorm2d
        module.running_mean.zero_()
        module.running_var.fill_(1.0)
        module.num_batches_tracked = torch.zeros((), dtype=torch.long, device=module.running_mean.device)
    return model


@torch.no_grad()
def _estimate(model: nn.Module, layers: Sequence[nn.Module], batches: Iterable[torch.Tensor]) -> None:
    """The running statistics of ``layers`` estimated on ``batches``: those layers in training mode with a
    cumulative average (momentum None), as ``update_bn`` does; every other module in evaluation mode (dropout off:
    the statistics the evaluated model meets, where ``update_bn`` runs the whole model in training mode)."""
    saved = []
    for m in layers:
        saved.append((m, m.__class__, m.momentum, m.training))
        if isinstance(m, (FrozenBatchNorm1d, FrozenBatchNorm2d)):
            m.__class__ = nn.BatchNorm1d if isinstance(m, FrozenBatchNorm1d) else nn.BatchNorm2d
        m.momentum = None
        m.num_batches_tracked = torch.zeros((), dtype=torch.long, device=m.running_mean.device)
        m.running_mean.zero_()
        m.running_var.fill_(1.0)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    for m in layers:
        m.train()
    for xb in batches:
        model(xb)
    for m, mode in modes:
        m.training = mode
    for m, cls, momentum, _ in saved:
        m.__class__, m.momentum = cls, momentum
        m.num_batches_tracked = None


def _fold(module: nn.Module, mean: torch.Tensor, var: torch.Tensor) -> None:
    """``module``'s affine parameters with ``(mean, var)`` folded in, its statistics set to ``(0, 1)``, frozen."""
    eps = module.eps
    scale = module.weight / torch.sqrt(var + eps)
    module.bias.sub_(scale * mean)
    module.weight.mul_(torch.sqrt(torch.tensor(1.0 + eps, dtype=var.dtype)) / torch.sqrt(var + eps))
    module.running_mean.zero_()
    module.running_var.fill_(1.0)
    if not isinstance(module, (FrozenBatchNorm1d, FrozenBatchNorm2d)):
        module.__class__ = FrozenBatchNorm1d if isinstance(module, nn.BatchNorm1d) else FrozenBatchNorm2d
    module.num_batches_tracked = None
    module.train(False)


def _unfold(module: nn.Module, mean: torch.Tensor, var: torch.Tensor) -> None:
    """The inverse of :func:`_fold`: the folded affine parameters read as ``(γ, β)`` under ``(mean, var)``."""
    eps = module.eps
    module.weight.mul_(torch.sqrt(var + eps) / torch.sqrt(torch.tensor(1.0 + eps, dtype=var.dtype)))
    module.bias.add_(module.weight * mean / torch.sqrt(var + eps))


def _chunks(x: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [x[i: i + batch_size] for i in range(0, x.shape[0], batch_size)]


@torch.no_grad()
def fold_statistics(model: nn.Module, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Estimate every BatchNorm's statistics on ``x`` ``(n, ...)`` (one pass in batches of ``batch_size``,
    every BatchNorm in training mode, the cumulative average of the batches' means and unbiased
    variances), fold them into the affine parameters and freeze the layers at ``(0, 1)``, in place.
    Returns the folded statistics ``(2 S,)`` float32 (each layer's ``μ`` then ``σ²``)."""
    layers = [m for _, m in batch_norms(model)]
    _estimate(model, layers, _chunks(x, batch_size))
    out = []
    for m in layers:
        mean, var = m.running_mean.clone(), m.running_var.clone()
        out += [mean.float().cpu(), var.float().cpu()]
        _fold(m, mean, var)
    return torch.cat(out) if out else torch.zeros(0)


def _split(model_layers: Sequence[nn.Module], stats: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sizes = [n for m in model_layers for n in (m.num_features, m.num_features)]
    parts = torch.split(stats, sizes)
    return [(parts[2 * i], parts[2 * i + 1]) for i in range(len(model_layers))]


@torch.no_grad()
def reset_statistics(model: nn.Module, target: torch.Tensor, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """RESET of a folded ``model`` on the server's inputs ``x`` ``(n, ...)``, in place: every BatchNorm read back as
    ``(γ, β)`` under ``target`` ``(2 S,)`` (the statistics its parameters were folded with), their statistics
    estimated on ``x`` as :func:`fold_statistics` does (one pass, every BatchNorm in training mode) and folded in
    again. Returns the estimated statistics ``(2 S,)`` float32."""
    layers = [m for _, m in batch_norms(model)]
    for m, (mean, var) in zip(layers, _split(layers, target)):
        _unfold(m, mean.to(m.weight), var.to(m.weight))
    return fold_statistics(model, x, batch_size)


def pooled_statistics(stats: Sequence[torch.Tensor], weights: Sequence[float], sizes: Sequence[int]) -> torch.Tensor:
    """The statistics of the mixture of the populations ``stats`` (each ``(2 S,)``, layers of ``sizes``
    channels) with ``weights``: per channel ``μ̄ = Σ w μ``, ``σ̄² = Σ w (σ² + μ²) − μ̄²`` (float64 sums).
    Returns ``(2 S,)`` float32."""
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    mean_parts, var_parts = [], []
    for s in stats:
        parts = torch.split(s.double(), [n for size in sizes for n in (size, size)])
        mean_parts.append(torch.cat(parts[0::2]))
        var_parts.append(torch.cat(parts[1::2]))
    means, variances = torch.stack(mean_parts), torch.stack(var_parts)
    mean = (w[:, None] * means).sum(0)
    var = ((w[:, None] * (variances + means.square())).sum(0) - mean.square()).clamp_min(0.0)
    out, start = [], 0
    for size in sizes:
        out += [mean[start: start + size], var[start: start + size]]
        start += size
    return torch.cat(out).float()
