"""Server-side Adam over K parameter vectors at once, with per-row clipping and selection of
the best iterate (on validation accuracy, else the objective). Used by fedbens and fedfisher."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posterior_fusion import ranges
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.settings_parsing import MethodSettings, setting
from posterior_fusion.fusion.types import FusionInputs
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.functional import batched_logits
from posterior_fusion.progress import progress


@dataclass(frozen=True)
class OptimiserSettings(MethodSettings):
    """Adam settings of the optimising methods (paper defaults)."""

    steps: int = setting(300, "Adam steps per mode.", bounds=ranges.STEPS)
    adam_lr: float = setting(1e-3, "Adam learning rate of the server optimisation.", bounds=ranges.LEARNING_RATE)
    clip: float = setting(1.0, "Gradient-norm clip per mode.", bounds=(1e-12, 1e12))
    val_every: int = setting(30, "With validation data: evaluate every this many steps (and at the last).", bounds=(1, 1_000_000))

    def validate(self) -> None:
        super().validate()
        if self.steps < 0 or self.adam_lr <= 0 or self.clip <= 0 or self.val_every < 1:
            raise ConfigError("settings need steps >= 0, adam_lr > 0, clip > 0 and val_every >= 1")


class Adam:
    """Adam (Kingma & Ba; torch.optim.Adam's defaults: betas (0.9, 0.999), eps 1e-8, bias
    correction, no weight decay) on one tensor. Written out so that fusing never imports
    ``torch._dynamo`` (which ``torch.optim`` does on its first step: seconds per CLI call);
    ``tests/test_design.py`` checks its iterates against ``torch.optim.Adam``."""

    def __init__(self, param: torch.Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        self.param, self.lr, self.betas, self.eps = param, lr, betas, eps
        self.m = torch.zeros_like(param)
        self.v = torch.zeros_like(param)
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        g = self.param.grad
        b1, b2 = self.betas
        self.t += 1
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (self.v / (1 - b2 ** self.t)).sqrt_().add_(self.eps)
        self.param.addcdiv_(self.m, denom, value=-self.lr / (1 - b1 ** self.t))

    def zero_grad(self) -> None:
        self.param.grad = None


class MomentumSGD:
    """SGD with momentum on a list of tensors (torch.optim.SGD's update without dampening,
    Nesterov or weight decay: b ← μ b + g, p ← p − lr b), written out for the same reason as
    :class:`Adam`; its ``lr`` may change between steps. Tested against ``torch.optim.SGD``."""

    def __init__(self, params, lr: float, momentum: float = 0.9) -> None:
        self.params = list(params)
        self.lr, self.momentum = lr, momentum
        self.bufs: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            b = self.bufs[i]
            b = p.grad.clone() if b is None else b.mul_(self.momentum).add_(p.grad)
            self.bufs[i] = b
            p.add_(b, alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def accuracy_of(spec: ModelSpec, W: torch.Tensor, data: SiloData) -> torch.Tensor:
    """Accuracy of each of the K weight vectors on ``data``: ``(K,)``."""
    x, y = data.tensors()
    return (batched_logits(spec, W, x).argmax(-1) == y).float().mean(-1)


def optimise_modes(objective: Callable[[torch.Tensor], torch.Tensor], W0: torch.Tensor, inputs: FusionInputs,
                   settings: OptimiserSettings, desc: str) -> tuple[torch.Tensor, list[list[dict]]]:
    """Adam on ``objective`` (``(K, d)`` -> ``(K,)``) from each row of ``W0`` ``(K, d)`` with per-row clipping.

    Keeps, per row, the iterate with the best validation accuracy (evaluated at step 0, every
    ``val_every`` steps and at the last step) if validation data is given, else the iterate
    with the lowest objective. Returns ``(best (K, d), history per row)``.
    """
    opts = inputs.options
    W = W0.clone().to(opts.device).requires_grad_(True)
    adam = Adam(W, lr=settings.adam_lr)
    K = W.shape[0]
    best = W0.clone()
    best_score = torch.full((K,), -math.inf)
    history: list[list[dict]] = [[] for _ in range(K)]
    last = settings.steps

    def consider(step: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            if inputs.val is not None:
                if step % settings.val_every != 0 and step != last:
                    return
                score = accuracy_of(inputs.spec, W.detach().cpu(), inputs.val)
            else:
                score = -values
            for k in range(K):
                entry = {"step": step, "objective": float(values[k])}
                if inputs.val is not None:
                    entry["val_accuracy"] = float(score[k])
                if inputs.val is not None or step % settings.val_every == 0 or step == last:
                    history[k].append(entry)
            score = score.cpu()
            improved = score > best_score
            best[improved] = W.detach().cpu()[improved]
            best_score[improved] = score[improved]

    bar = progress(range(last + 1), desc, show=opts.progress)
    for step in bar:
        values = objective(W)
        consider(step, values.detach().cpu())
        if step == last:
            break
        adam.zero_grad()
        values.sum().backward()
        with torch.no_grad():
            norms = W.grad.norm(dim=1, keepdim=True)
            W.grad.mul_(torch.clamp(settings.clip / (norms + 1e-12), max=1.0))
        adam.step()
        bar.set_postfix(objective=f"{values.mean().item():.4g}")
    return best, history
