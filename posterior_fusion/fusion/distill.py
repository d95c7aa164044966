"""Knowledge distillation of an ensemble into one model on unlabeled server data (FedBE's
server step, ``004``, section 5.1), shared by ``fedbe`` and ``pfuse fuse --distill``.

The teachers' averaged softmax on the unlabeled inputs is sharpened, p[c] ← p[c]^s / Σ p^s
(FedBE: s = 2), and one model, started from the given weights (FedBE: the weight average), is
trained on it with momentum SGD and SWA: a cyclic step size decaying from ``lr_max`` to
``lr_min`` within every cycle of ``cycle`` steps, the weights collected at the end of every
cycle after step ``swa_start`` and averaged (FedBE: 1e-3 → 4e-4, 25 steps, after step 250,
20 epochs, batch 128). Without any collected model the last iterate is returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.distill_settings import RecipeChoice, TeachingConfig
from posterior_fusion.fusion.optimise import MomentumSGD
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.functional import batched_logits
from posterior_fusion.pooling import AVERAGE, Pooling
from posterior_fusion.progress import progress
from posterior_fusion.settings import check_declared, record_from, setting


@dataclass(frozen=True)
class DistillConfig:
    """FedBE's distillation schedule (``fuse --distill-recipe swa``; the defaults are the paper's)."""

    epochs: int = setting(20, "Epochs over the unlabeled inputs.", bounds=(0, 10_000))
    batch_size: int = setting(128, "Inputs per step.", bounds=(1, 2**20))
    lr_max: float = setting(1e-3, "The cyclic step size's top.", bounds=(1e-12, 10.0))
    lr_min: float = setting(4e-4, "The cyclic step size's bottom (at most lr_max).", bounds=(1e-12, 10.0))
    cycle: int = setting(25, "Steps per cycle of the step size; SWA collects the student at each cycle's end.",
                         bounds=(1, 10**6))
    swa_start: int = setting(250, "Steps before SWA starts collecting.", bounds=(0, 10**9))
    momentum: float = setting(0.9, "SGD momentum.", bounds=(0.0, 0.999999))
    sharpen: float = setting(2.0, "Power of the pseudo-labels' sharpening (1: none).", bounds=(1e-6, 100.0))

    def validate(self) -> None:
        check_declared(self, "distillation")
        if self.lr_min > self.lr_max:
            raise ConfigError(f"distillation setting lr_min ({self.lr_min:g}) must be at most lr_max ({self.lr_max:g})")

    def to_json(self) -> dict:
        return asdict(self)


def swa_lr(step: int, cfg: DistillConfig) -> float:
    """Step size at (0-based) ``step``: SWA's cyclic schedule (1 − t) lr_max + t lr_min with
    t = ((step mod cycle) + 1) / cycle, so the last step of every cycle uses ``lr_min``."""
    t = ((step % cfg.cycle) + 1) / cfg.cycle
    return (1 - t) * cfg.lr_max + t * cfg.lr_min


def collects(step: int, cfg: DistillConfig) -> bool:
    """Whether the weights after (0-based) ``step`` enter the SWA average: end of a cycle, after ``swa_start``."""
    return (step + 1) % cfg.cycle == 0 and step + 1 > cfg.swa_start


def soft_labels(spec: ModelSpec, teachers: torch.Tensor, x: torch.Tensor, sharpen: float = 2.0,
                chunk: int = 1024, weights: torch.Tensor | None = None,
                pooling: Pooling = AVERAGE) -> torch.Tensor:
    """Sharpened prediction of the teachers ``(K, d)`` on ``x`` ``(n, ...)``: ``(n, classes)`` — their
    softmax combined as their artifact would predict (``pooling``; by default the mean, weighted by
    ``weights`` ``(K,)`` when given)."""
    parts = []
    for i in range(0, x.shape[0], chunk):
        p = pooling.combine(torch.softmax(batched_logits(spec, teachers, x[i : i + chunk]), -1), weights).float()
        p = p.pow(sharpen)
        parts.append(p / p.sum(-1, keepdim=True))
    return torch.cat(parts)


def distill(spec: ModelSpec, teachers: torch.Tensor, start: torch.Tensor, x: torch.Tensor,
            cfg: DistillConfig | None = None, generator: torch.Generator | None = None,
            show_progress: bool = True, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """One model ``(d,)`` distilled from the teachers ``(K, d)`` on unlabeled inputs ``x``, and a
    record (steps, models averaged, the config). ``targets``: the teachers' :func:`soft_labels` on
    ``x`` when the caller has them already."""
    cfg = cfg or DistillConfig()
    cfg.validate()
    if targets is None:
        targets = soft_labels(spec, teachers, x, cfg.sharpen)
    model = spec.build()
    vector_to_parameters(start.detach().clone().float(), model.parameters())
    model.train()
    opt = MomentumSGD(model.parameters(), lr=cfg.lr_max, momentum=cfg.momentum)  # no torch._dynamo import
    swa, count, step = None, 0, 0
    for _ in progress(range(cfg.epochs), "distill", show=show_progress):
        perm = torch.randperm(x.shape[0], generator=generator)
        for i in range(0, x.shape[0], cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            opt.lr = swa_lr(step, cfg)
            loss = -(targets[idx] * torch.log_softmax(model(x[idx]), -1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if collects(step, cfg):
                w = parameters_to_vector(model.parameters()).detach()
                count += 1
                swa = w.clone() if swa is None else swa + (w - swa) / count
            step += 1
    out = swa if swa is not None else parameters_to_vector(model.parameters()).detach().clone()
    return out, {"steps": step, "swa_models": count, "teachers": int(teachers.shape[0]), "config": cfg.to_json()}


def fit_to_soft_labels(spec: ModelSpec, candidates: torch.Tensor, x: torch.Tensor, targets: torch.Tensor,
                       chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """How well each candidate ``(K, d)`` fits the soft labels ``targets`` ``(n, classes)`` on ``x``
    ``(n, ...)``: ``(agreement (K,), cross-entropy (K,))`` — the share of inputs whose top class is
    the targets' top class, and the mean cross-entropy to the targets (float64)."""
    agree = torch.zeros(candidates.shape[0], dtype=torch.float64)
    ce = torch.zeros(candidates.shape[0], dtype=torch.float64)
    for i in range(0, x.shape[0], chunk):
        logp = torch.log_softmax(batched_logits(spec, candidates, x[i : i + chunk]), -1)   # (K, b, classes)
        t = targets[i : i + chunk]
        ce -= (t * logp).sum((1, 2)).double()
        agree += (logp.argmax(-1) == t.argmax(-1)).sum(1).double()
    return agree / x.shape[0], ce / x.shape[0]


def distill_members(spec: ModelSpec, members: list[torch.Tensor], x: torch.Tensor, cfg: DistillConfig | None = None,
                    seed: int = 0, show_progress: bool = True, weights: torch.Tensor | None = None,
                    pooling: Pooling = AVERAGE) -> tuple[torch.Tensor, dict]:
    """Any ensemble (``pfuse fuse --distill``): its members ``(d,)`` as teachers, their prediction
    combined by ``pooling`` with mixture ``weights`` (:func:`soft_labels`).

    The student starts from whichever of {the members' mean, each member} agrees most often with
    the teachers' top class on ``x`` (ties: the lower cross-entropy to their sharpened soft
    labels). FedBE starts from the mean, which is right when the members share a starting point;
    the members of a mixture or of a client ensemble come from different starts, where the mean of
    their weights predicts near-uniformly — which cross-entropy alone prefers to a confident member
    that is wrong on other clients' classes — and the small distillation step size never leaves it.
    The choice is recorded as ``start`` (``"mean"`` or ``"member i"``) with its ``start_agreement``."""
    cfg = cfg or DistillConfig()
    cfg.validate()
    teachers = torch.stack([m.float() for m in members])
    candidates = torch.cat([teachers.mean(0, keepdim=True), teachers])
    targets = soft_labels(spec, teachers, x, cfg.sharpen, weights=weights, pooling=pooling)
    agree, ce = fit_to_soft_labels(spec, candidates, x, targets)
    best = min(range(candidates.shape[0]), key=lambda i: (-float(agree[i]), float(ce[i])))
    w, record = distill(spec, teachers, candidates[best], x, cfg, torch.Generator().manual_seed(seed), show_progress,
                        targets)
    record.update(start="mean" if best == 0 else f"member {best - 1}", start_agreement=float(agree[best]))
    return w, record


def distill_config(recipe: RecipeChoice, teaching: Mapping[str, Any], unlabeled: bool,
                   where: str = "") -> DistillConfig | TeachingConfig:
    """The distillation record of one run, from the same settings wherever they are given (``fuse --distill``, a
    Flower round's ``distill-*`` keys, the library).

    Args:
        recipe: the recipe and FedBE's schedule length (:class:`RecipeChoice`).
        teaching: the consistent recipe's settings that were given (name -> value or text); the rest keep their
            declared defaults. Refused with ``swa``, whose schedule is FedBE's own.
        unlabeled: whether the server has unlabeled inputs (``swa`` needs them; ``consistent`` without them is
            data-free).
        where: what the messages call the settings' source.

    Returns:
        :class:`DistillConfig` for ``swa``, :class:`TeachingConfig` for ``consistent``; ConfigError otherwise.
    """
    if recipe.recipe == "swa":
        if teaching:
            raise ConfigError(f"{where}`distill_{next(iter(teaching))}` is a setting of the consistent recipe, "
                              "not of swa")
        if not unlabeled:
            raise ConfigError(f"{where}`distill_recipe` swa needs unlabeled server data (`unlabeled`)")
        return DistillConfig(epochs=20 if recipe.epochs is None else recipe.epochs)
    unknown = sorted(set(teaching) - set(TeachingConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"{where}no consistent-recipe setting `distill_{unknown[0]}`")
    return record_from(TeachingConfig, teaching, where.rstrip(": "), prefix="distill_")
