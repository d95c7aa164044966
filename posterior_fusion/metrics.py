"""Predictive metrics of an ensemble: accuracy, NLL, ECE, Brier, per-member accuracy."""

from __future__ import annotations

import numpy as np
import torch

from posterior_fusion import budget
from posterior_fusion.data.silo import SiloData
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.functional import batched_logits


def ensemble_probabilities(spec: ModelSpec, members: list[torch.Tensor] | torch.Tensor,
                           x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean probabilities (n, C), per-member probabilities (K, n, C))`` (softmax averaging)."""
    W = torch.stack(list(members)) if not isinstance(members, torch.Tensor) else members
    probs = torch.softmax(batched_logits(spec, W, x), dim=-1)
    return probs.mean(0), probs


def expected_calibration_error(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> tuple[float, list[dict]]:
    """ECE with ``bins`` equal-width confidence bins; also returns the per-bin table."""
    conf, pred = probs.max(-1)
    correct = (pred == y).float()
    edges = torch.linspace(0, 1, bins + 1)
    ece, table = 0.0, []
    for lo, hi in zip(edges[:-1], edges[1:]):
        mask = (conf > lo) & (conf <= hi) if lo > 0 else (conf >= lo) & (conf <= hi)
        count = int(mask.sum())
        if count:
            acc, avg_conf = correct[mask].mean().item(), conf[mask].mean().item()
            ece += count / len(y) * abs(acc - avg_conf)
            table.append({"lo": float(lo), "hi": float(hi), "count": count, "accuracy": acc, "confidence": avg_conf})
        else:
            table.append({"lo": float(lo), "hi": float(hi), "count": 0, "accuracy": None, "confidence": None})
    return ece, table


def classification_metrics(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> dict:
    """Accuracy, NLL, ECE and Brier score of probabilities ``(n, C)`` for labels ``(n,)``."""
    eps = 1e-12
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1]).to(probs.dtype)
    ece, table = expected_calibration_error(probs, y, bins)
    return {
        "accuracy": (probs.argmax(-1) == y).float().mean().item(),
        "nll": -torch.log(probs.gather(1, y[:, None]).clamp_min(eps)).mean().item(),
        "ece": ece,
        "brier": (probs - onehot).square().sum(-1).mean().item(),
        "reliability": table,
    }


def check_data(spec: ModelSpec, data: SiloData, members: int = 1, max_memory: int | str | None = None) -> None:
    """Refuse data that does not fit ``spec`` (shape, classes) or whose evaluation by ``members``
    models would exceed the memory budget — before any forward pass."""
    where = data.source or "data"
    spec.check_input(data.input_shape(), where)
    budget.require(len(data) * (2 * members * spec.num_classes + int(np.prod(data.input_shape()))) * 4,
                   f"evaluating {members} members on {where}", max_memory)


def evaluate_members(spec: ModelSpec, members: list[torch.Tensor], data: SiloData, bins: int = 15,
                     max_memory: int | str | None = None) -> dict:
    """Metrics of the averaged ensemble plus min/max accuracy of the single members."""
    check_data(spec, data, len(members), max_memory)
    x, y = data.tensors()
    mean, per_member = ensemble_probabilities(spec, members, x)
    out = classification_metrics(mean, y, bins)
    member_acc = (per_member.argmax(-1) == y).float().mean(-1)
    out.update({"num_members": len(members), "member_accuracy_min": member_acc.min().item(),
                "member_accuracy_max": member_acc.max().item(), "n": len(y)})
    return out


def reliability_plot(table: list[dict], path: str, title: str = "") -> None:
    """Write a reliability diagram PNG (needs matplotlib: pip install posterior-fusion[plot])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from posterior_fusion.errors import ConfigError

        raise ConfigError("--plot needs matplotlib (pip install 'posterior-fusion[plot]')") from None
    fig, ax = plt.subplots(figsize=(4, 4))
    mids = [(b["lo"] + b["hi"]) / 2 for b in table]
    accs = [b["accuracy"] or 0.0 for b in table]
    ax.bar(mids, accs, width=1 / len(table), edgecolor="k", alpha=0.7, label="accuracy")
    ax.plot([0, 1], [0, 1], "r--", label="perfect calibration")
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
