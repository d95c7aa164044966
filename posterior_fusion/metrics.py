"""Predictive metrics of an ensemble: accuracy, NLL, ECE, Brier, per-member accuracy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from posterior_fusion import budget, ranges
from posterior_fusion.data.silo import SiloData
from posterior_fusion.data.transform import check_transform
from posterior_fusion.files import write_atomically
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.functional import batched_logits
from posterior_fusion.models.members import non_finite_predictive
from posterior_fusion.pooling import AVERAGE, Pooling
from posterior_fusion.predictive import LOGIT_MOMENTS, probit


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


def maximum_calibration_error(table: list[dict]) -> float:
    """MCE: the largest |accuracy − confidence| over the non-empty bins of a reliability table."""
    gaps = [abs(b["accuracy"] - b["confidence"]) for b in table if b["count"]]
    return max(gaps) if gaps else 0.0


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Predictive entropy ``(n,)`` in nats of probabilities ``(n, C)``."""
    return -(probs * probs.clamp_min(1e-12).log()).sum(-1)


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for the boolean labels ``positive`` (Mann–Whitney
    statistic with average ranks for ties); NaN when one class is empty."""
    scores = scores.double().flatten()
    positive = positive.bool().flatten()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    uniq, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    if len(uniq) < len(scores):  # average ranks of ties
        first = torch.cumsum(counts, 0) - counts + 1
        avg = first + (counts - 1) / 2.0
        ranks[order] = avg[inverse].double()
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


COVERAGES = (0.5, 0.7, 0.8, 0.9, 0.95, 1.0)


def accuracy_coverage(probs: torch.Tensor, y: torch.Tensor, coverages=COVERAGES) -> list[dict]:
    """Selective accuracy: the accuracy on the most confident fraction ``coverage`` of the inputs."""
    conf, pred = probs.max(-1)
    correct = (pred == y).double()[torch.argsort(conf, descending=True)]
    out = []
    for cov in coverages:
        k = max(1, int(round(cov * len(y))))
        out.append({"coverage": float(cov), "accuracy": float(correct[:k].mean())})
    return out


def classification_metrics(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> dict:
    """Accuracy, NLL, ECE, MCE, Brier score, mean entropy, AUROC of correct-vs-incorrect from
    the confidence, and the accuracy–coverage curve of probabilities ``(n, C)`` for labels ``(n,)``."""
    eps = 1e-12
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1]).to(probs.dtype)
    ece, table = expected_calibration_error(probs, y, bins)
    conf, pred = probs.max(-1)
    return {
        "accuracy": (pred == y).float().mean().item(),
        "nll": -torch.log(probs.gather(1, y[:, None]).clamp_min(eps)).mean().item(),
        "ece": ece,
        "mce": maximum_calibration_error(table),
        "brier": (probs - onehot).square().sum(-1).mean().item(),
        "entropy_mean": entropy(probs).mean().item(),
        "auroc_correct": auroc(conf, pred == y),
        "accuracy_coverage": accuracy_coverage(probs, y),
        "reliability": table,
    }


def ood_auroc(probs_in: torch.Tensor, probs_out: torch.Tensor) -> float:
    """OOD detection AUROC from predictive entropy (out-of-distribution = positive), FedPPD's protocol."""
    scores = torch.cat([entropy(probs_in), entropy(probs_out)])
    labels = torch.cat([torch.zeros(len(probs_in), dtype=torch.bool), torch.ones(len(probs_out), dtype=torch.bool)])
    return auroc(scores, labels)


def check_data(spec: ModelSpec, data: SiloData, members: int = 1, max_memory: int | str | None = None,
               expected_transform: dict | None = None, artifact: str = "the artifact") -> None:
    """Refuse data that does not fit ``spec`` (shape, classes) or whose evaluation by ``members``
    models would exceed the memory budget — before any forward pass."""
    where = data.source or "data"
    spec.check_input(data.input_shape(), where)
    spec.check_token_ids(data.x, where)
    if expected_transform is not None:
        check_transform(expected_transform, data.input_transform, where, artifact)
    budget.require(len(data) * (2 * members * spec.num_classes + int(np.prod(data.input_shape()))) * 4,
                   f"evaluating {members} members on {where}", max_memory)


def evaluate_members(spec: ModelSpec, members: list[torch.Tensor], data: SiloData, bins: int = 15,
                     max_memory: int | str | None = None, weights: torch.Tensor | None = None,
                     pooling: Pooling = AVERAGE) -> dict:
    """Metrics of the members' combined prediction (``pooling``: by default the average with mixture
    ``weights``, uniform if ``None``) plus min/max accuracy of the single members."""
    check_data(spec, data, len(members), max_memory)
    x, y = data.tensors()
    _, per_member = ensemble_probabilities(spec, members, x)
    return member_metrics(per_member, y, bins, weights, pooling)


def member_metrics(per_member: torch.Tensor, y: torch.Tensor, bins: int = 15, weights: torch.Tensor | None = None,
                   pooling: Pooling = AVERAGE) -> dict:
    """:func:`evaluate_members`' metrics from the members' probabilities ``(K, n, C)`` for labels ``(n,)``."""
    out = classification_metrics(pooling.combine(per_member, weights).float(), y, bins)
    member_acc = (per_member.argmax(-1) == y).float().mean(-1)
    finite = torch.isfinite(per_member).all(-1)  # (K, n)
    out.update({"num_members": len(per_member), "member_accuracy_min": member_acc.min().item(),
                "member_accuracy_max": member_acc.max().item(), "n": len(y),
                "non_finite_inputs": int((~finite.all(0)).sum()),
                "non_finite_members": [k for k in range(len(finite)) if not finite[k].all()]})
    return out


def evaluate_posterior(global_artifact, data: SiloData, predictive: str = "map", samples: int = 30,
                       scale: float = 1.0, link: str = "probit", bins: int = 15, ood: SiloData | None = None,
                       max_memory: int | str | None = None) -> dict:
    """Metrics of a global artifact's predictive (``map`` ensemble, ``mc`` or ``glm``) on ``data``;
    with ``ood`` data also the OOD AUROC from predictive entropy."""
    g = global_artifact
    ranges.check("bins", bins, ranges.BINS)
    check_data(g.model_spec, data, 1, max_memory, g.metadata.get("input_transform"), g.path)
    if predictive == "map":
        out = evaluate_members(g.model_spec, list(g.members), data, bins, max_memory, g.mode_weights, g.pooling)
        if out["non_finite_inputs"]:
            raise non_finite_predictive(g.path, out["non_finite_inputs"], out["n"], g.metadata)
        x = data.inputs()
        probs_in = None
    else:
        check_data(g.model_spec, data, len(g.members) * (samples if predictive == "mc" else g.model_spec.num_classes),
                   max_memory)
        x, y = data.tensors()
        probs_in = g.predict(x, predictive, samples, scale, link, max_memory=max_memory, raw=True)
        out = classification_metrics(probs_in, y, bins)
        out.update({"num_members": len(g.members), "n": len(y)})
    out.update({"predictive": predictive, "samples": samples if predictive == "mc" or link == "mc" else None,
                "scale": scale})
    if ood is not None:
        check_data(g.model_spec, ood, len(g.members), max_memory, g.metadata.get("input_transform"), g.path)
        if probs_in is None:
            probs_in = g.predict(x, predictive, samples, scale, link, max_memory=max_memory, raw=True)
        probs_out = g.predict(ood.inputs(), predictive, samples, scale, link, max_memory=max_memory, raw=True)
        out["ood_auroc"] = ood_auroc(probs_in, probs_out)
        out["ood_n"] = len(ood)
    return out


SCALE_GRID = (1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0)


def choose_scale(global_artifact, val: SiloData, predictive: str, samples: int = 30, link: str = "probit",
                 grid=SCALE_GRID) -> tuple[float, list[dict]]:
    """Predictive tempering: the covariance scale with the lowest NLL on labelled validation
    data (ties: the larger scale), and the grid's table. ``map`` needs no scale (returns 1)."""
    if predictive == "map":
        return 1.0, []
    x, y = val.tensors()
    g = global_artifact
    moments = None
    if predictive in LOGIT_MOMENTS and link == "probit":  # the covariance scales linearly: compute once
        moments = [LOGIT_MOMENTS[predictive](g.model_spec, w, g.precision(k), x) for k, w in enumerate(g.members)]
    table = []
    for s in grid:
        if moments is not None:
            p = sum(float(pi) * probit(m, s * c) for pi, (m, c) in zip(g.mode_weights, moments)).float()
        else:
            p = g.predict(x, predictive, samples, s, link, raw=True)
        nll = -torch.log(p.gather(1, y[:, None]).clamp_min(1e-12)).mean().item()
        table.append({"scale": s, "val_nll": nll, "val_accuracy": (p.argmax(-1) == y).float().mean().item()})
    best = min(table, key=lambda r: (r["val_nll"], -r["scale"]))
    return best["scale"], table


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from posterior_fusion.errors import ConfigError

        raise ConfigError("`plot` needs matplotlib (pip install 'posterior-fusion[plot]')") from None
    return plt


def reliability_plot(results: list[tuple[str, dict]], path: str, dataset: str = "") -> None:
    """Reliability diagrams of one or more methods (``(label, metrics)`` pairs, metrics as from
    :func:`classification_metrics`), overlaid, with the gap to the diagonal shaded, a per-bin
    count histogram underneath, n and the data set in the title, and the accuracy–coverage
    curves beside; the format follows the file extension (.png, .pdf, .svg)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(7.0, 5.0), gridspec_kw={"height_ratios": [3, 1]}, sharex="col")
    ax, cov_ax, hist_ax, spare = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    spare.axis("off")
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    n_bins = len(results[0][1]["reliability"])
    width = 1.0 / n_bins / max(1, len(results))
    for i, (label, m) in enumerate(results):
        table = m["reliability"]
        mids = [(b["lo"] + b["hi"]) / 2 for b in table if b["count"]]
        accs = [b["accuracy"] for b in table if b["count"]]
        confs = [b["confidence"] for b in table if b["count"]]
        line = ax.plot(confs, accs, marker="o", ms=3, label=f"{label} (ECE {m['ece']:.3f})")[0]
        ax.fill_between(confs, accs, confs, color=line.get_color(), alpha=0.15)
        hist_ax.bar([mid - 0.5 / n_bins + (i + 0.5) * width for mid in mids], [b["count"] for b in table if b["count"]],
                    width=width, color=line.get_color(), alpha=0.7)
        cov = m.get("accuracy_coverage") or []
        cov_ax.plot([c["coverage"] for c in cov], [c["accuracy"] for c in cov], marker="o", ms=3,
                    color=line.get_color(), label=label)
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left")
    n = results[0][1].get("n", "?")
    ax.set_title(f"reliability, {dataset} (n={n})" if dataset else f"reliability (n={n})", fontsize=9)
    hist_ax.set_xlabel("confidence")
    hist_ax.set_ylabel("count")
    hist_ax.set_yscale("log")
    cov_ax.set_xlabel("coverage (most confident fraction)")
    cov_ax.set_ylabel("selective accuracy")
    cov_ax.set_title("accuracy–coverage", fontsize=9)
    cov_ax.tick_params(labelbottom=True)
    fig.tight_layout()
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=150, format=fmt))  # never through a link
    plt.close(fig)
