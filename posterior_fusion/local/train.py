"""Local MAP training (momentum SGD, the paper's recipe, or Adam / AdamW, with a schedule and clipping) and
optional SWAG moment collection."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from posterior_fusion.errors import NonFiniteOutputError
from posterior_fusion.local.fit_config import TrainConfig
from posterior_fusion.posterior import SwagMoments
from posterior_fusion.progress import progress


@dataclass(frozen=True)
class TrainResult:
    final_loss: float
    final_accuracy: float
    swag: SwagMoments | None


class SwagCollector:
    """SWAG moments (Maddox et al. 2019) of the iterates of a training run: over the last ``swag_epochs`` epochs
    (0: a quarter), ``swag_snapshots_per_epoch`` snapshots per epoch of ``steps`` steps, the running mean and
    second moment ``(d,)`` and the last ``swag_rank`` deviations from the running mean; nothing when ``swag`` is
    off."""

    def __init__(self, cfg: TrainConfig, steps: int) -> None:
        self.cfg = cfg
        self.first_epoch = cfg.epochs - ((cfg.swag_epochs or max(1, cfg.epochs // 4)) if cfg.swag else 0)
        self.every = max(1, steps // max(1, cfg.swag_snapshots_per_epoch))
        self.count = 0
        self.mean: torch.Tensor | None = None
        self.sq: torch.Tensor | None = None
        self.devs: list[torch.Tensor] = []

    def after_step(self, model: nn.Module, epoch: int, step: int) -> None:
        """Take a snapshot of ``model``'s weights if step ``step`` (from 0) of epoch ``epoch`` is one."""
        if not self.cfg.swag or epoch < self.first_epoch or (step + 1) % self.every:
            return
        w = parameters_to_vector(model.parameters()).detach().double()
        self.count += 1
        self.mean = w.clone() if self.mean is None else self.mean + (w - self.mean) / self.count
        self.sq = w.square() if self.sq is None else self.sq + (w.square() - self.sq) / self.count
        self.devs = [*self.devs, (w - self.mean).float()][-self.cfg.swag_rank:]

    def moments(self) -> SwagMoments | None:
        """The collected moments (None without ``swag`` or snapshots), warning when fewer than ``swag_rank``."""
        if self.cfg.swag and self.count < self.cfg.swag_rank:
            warnings.warn(f"SWAG collected {self.count} snapshots, fewer than swag_rank={self.cfg.swag_rank}: the "
                          f"deviation matrix has rank {self.count} (train longer or lower --swag-rank)", stacklevel=3)
        if not self.cfg.swag or self.count == 0:
            return None
        return SwagMoments(self.mean.float().cpu(), self.sq.float().cpu(), torch.stack(self.devs).cpu())


def prior_centres(params: list[torch.Tensor], prior_mean: torch.Tensor | None) -> list[torch.Tensor]:
    """The prior's centre per parameter: ``prior_mean`` ``(d,)`` split in ``params``' order and shaped like each
    (on its device), or zeros (the prior centred at zero) when None."""
    if prior_mean is None:
        return [torch.zeros_like(p) for p in params]
    return [c.detach().view_as(p).to(p.device) for c, p in zip(torch.split(prior_mean, [p.numel() for p in params]),
                                                                params)]


def training_diverged(desc: str, epoch: int, cfg: TrainConfig, what: str) -> NonFiniteOutputError:
    """The one line for a training run that left the finite numbers in epoch ``epoch`` (from 0)."""
    return NonFiniteOutputError(f"{desc}: training diverged in epoch {epoch + 1} of {cfg.epochs} ({what}): lower "
                                f"`lr` ({cfg.lr:g}) or raise `batch_size` ({cfg.batch_size}); nothing of it is written")


def make_optimizer(params: list[torch.Tensor], cfg: TrainConfig, centred_at_zero: bool):
    """``(optimizer, whether the prior's pull is in the gradient)`` for ``cfg.optimizer``. SGD keeps the decay
    toward zero in torch's own ``weight_decay`` (toward a base it is added to the gradient by the caller); Adam
    has it in the gradient too; AdamW applies it decoupled (by the caller)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay if centred_at_zero else 0.0), True
    if cfg.optimizer == "adam":  # Adam's own weight_decay is the L2 pull in the gradient
        return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.momentum, 0.999),
                                weight_decay=cfg.weight_decay if centred_at_zero else 0.0), True
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=0.0), False


def learning_rate_factor(step: int, total: int, warmup: float, schedule: str) -> float:
    """The schedule's factor of the peak learning rate at ``step`` of ``total``: linear warm-up over ``warmup``
    steps, then constant or a cosine decay to 0 over the rest."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        span = max(1.0, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / span)))
    return 1.0


def train_map(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig,
              seed: int, desc: str = "train", soft_targets: torch.Tensor | None = None,
              soft_weight: float = 0.0, prior_mean: torch.Tensor | None = None) -> TrainResult:
    """Train ``model`` in place on ``x`` ``(n, ...)``, ``y`` ``(n,)``; shuffling uses ``seed``.

    ``cfg.weight_decay`` must be resolved (see :meth:`FitConfig.resolved`). With
    ``soft_targets`` ``(n, classes)`` (a teacher's probabilities) the loss is
    ``(1 − soft_weight) · CE(y) + soft_weight · CE(soft_targets)`` (HBFL's eq. 4.2 with
    α = 1 − soft_weight; the cross-entropy equals the KL up to a constant). ``prior_mean`` ``(d,)``: the weight
    decay pulls to it (the gradient of ``½ wd ‖w − prior_mean‖²``, the prior centred at a pretrained base)
    instead of to zero."""
    if cfg.weight_decay is None:
        raise ValueError("train_map needs a resolved weight decay (FitConfig.resolved(n))")
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    centres = None if prior_mean is None else prior_centres(params, prior_mean)
    opt, decay_in_gradient = make_optimizer(params, cfg, centres is None)
    total_steps = cfg.epochs * math.ceil(x.shape[0] / cfg.batch_size)
    schedule = None if cfg.schedule == "constant" and cfg.warmup_epochs == 0 else torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: learning_rate_factor(t, total_steps, cfg.warmup_epochs * math.ceil(x.shape[0] / cfg.batch_size),
                                            cfg.schedule))
    loss_fn = nn.CrossEntropyLoss()
    n = x.shape[0]
    steps = math.ceil(n / cfg.batch_size)
    if n > 1 and n % cfg.batch_size == 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        steps -= 1  # a final batch of one sample cannot give BatchNorm batch statistics: left out of the epoch
    swag = SwagCollector(cfg, steps)
    loss_sum = correct = 0.0
    model.train()
    # the epoch's sums stay on x's device (float64: the same arithmetic as Python floats) and are read once per
    # epoch — a read per step would make a GPU wait for every step before launching the next
    bar = progress(range(cfg.epochs), f"{desc} training")
    for epoch in bar:
        perm = torch.randperm(n, generator=gen).to(x.device)
        loss_acc = torch.zeros((), dtype=torch.float64, device=x.device)
        correct_acc = torch.zeros((), dtype=torch.int64, device=x.device)
        for step in range(steps):
            idx = perm[step * cfg.batch_size : (step + 1) * cfg.batch_size]
            out = model(x[idx])
            loss = loss_fn(out, y[idx])
            if soft_targets is not None and soft_weight > 0:
                soft = -(soft_targets[idx] * torch.log_softmax(out, -1)).sum(-1).mean()
                loss = (1 - soft_weight) * loss + soft_weight * soft
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip is not None:  # the data term's gradient; the prior's pull is added after
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            if decay_in_gradient and centres is not None:
                with torch.no_grad():
                    for p, c in zip(params, centres):
                        if p.grad is not None:  # as SGD: a parameter without a gradient is not decayed
                            p.grad.add_(p - c, alpha=cfg.weight_decay)
            if not decay_in_gradient:  # AdamW: w <- w - lr wd (w - centre), before the Adam step
                with torch.no_grad():
                    rate = opt.param_groups[0]["lr"] * cfg.weight_decay
                    for p, c in zip(params, centres or [None] * len(params)):
                        if p.grad is not None:
                            p.sub_(rate * (p if c is None else p - c))
            opt.step()
            if schedule is not None:
                schedule.step()
            loss_acc += loss.detach().double() * len(idx)
            correct_acc += (out.argmax(-1) == y[idx]).sum()
            swag.after_step(model, epoch, step)
        loss_sum, correct = loss_acc.item(), float(correct_acc.item())
        if not math.isfinite(loss_sum):  # SGD does not come back from NaN: stop here, not after the last epoch
            raise training_diverged(desc, epoch, cfg, f"the loss is {loss_sum / n}")
        bar.set_postfix(loss=f"{loss_sum / n:.4f}", acc=f"{correct / n:.3f}")
    model.eval()
    return TrainResult(loss_sum / n, correct / n, swag.moments())
