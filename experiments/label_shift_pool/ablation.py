"""Which part of the label-shift pooling carries its gain: on every fitted cell of
a grid, the clients' own predictives (each client's members averaged) on the cell's test set,
combined by

* ``average`` — the client ensemble (each client weighted by its members: all equal here);
* ``prior-corrected average`` — each client's predictive moved to the pooled label prior
  (Saerens et al. 2002: ``p_c(y|x) π(y)/π_c(y)``, renormalised), then averaged;
* ``geometric`` — the normalised geometric mean of the clients (a product of experts, no counts);
* ``label-shift, equal weights`` — the pooling with ``w_c(y) = 1/C`` (prior correction and the
  ``a_c`` fixed point, but no per-class weights);
* ``label-shift, a_c = 1`` — the pooling without the fixed point (``iterations = 0``);
* ``label-shift`` at smoothing 0.1, 0.5 (the default) and 2;
* ``label-shift, smoothed label priors`` — the pooling with every count smoothed, in the priors as in
  the weights (``π_c ∝ n_c + s``, ``π ∝ Σ_c (n_c + s)``, every client weighing in on every class): not
  exact for exact client posteriors (``docs/methods.md``);
* ``label-shift, robust`` — the robust pool (``fuse --robust``: count claims capped, a client unlike
  the others left out; here every client is honest).

Formulas as in ``posterior_fusion/pooling.py``; the ablations are written out here. One row per
cell and rule (accuracy, NLL, ECE) to ``--json``.

    .venv/bin/python experiments/label_shift_pool/ablation.py runs/label_shift_pool --json OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import posterior_fusion
from posterior_fusion.data.silo import read_silo
from posterior_fusion.experiment.measure import save_rows
from posterior_fusion.metrics import classification_metrics
from posterior_fusion.pooling import label_shift_pool, robust_label_shift_pool


def equal_weight_pool(p: torch.Tensor, counts: torch.Tensor, s: float, iterations: int = 100) -> torch.Tensor:
    """The label-shift fixed point with ``w_c(y) = 1/C`` (written out, not the library's)."""
    c = counts + s
    prior_c = c / c.sum(1, keepdim=True)
    prior = c.sum(0) / c.sum()
    base = prior.log() + (p.clamp_min(1e-300).log() - prior_c.log()[:, None, :]).mean(0)
    q = torch.softmax(base, -1)
    for _ in range(iterations):
        log_a = torch.einsum("cy,ny->cn", prior_c / prior, q).log()
        q = torch.softmax(base + log_a.mean(0)[:, None], -1)
    return q


def smoothed_prior_pool(p: torch.Tensor, counts: torch.Tensor, s: float, iterations: int = 100) -> torch.Tensor:
    """The label-shift fixed point with every count smoothed (priors and weights; written out)."""
    c = counts + s
    prior_c = c / c.sum(1, keepdim=True)
    prior = c.sum(0) / c.sum()
    w = c / c.sum(0, keepdim=True)
    base = prior.log() + (w[:, None, :] * (p.clamp_min(1e-300).log() - prior_c.log()[:, None, :])).sum(0)
    q = torch.softmax(base, -1)
    for _ in range(iterations):
        log_a = torch.einsum("cy,ny->cn", prior_c / prior, q).log()
        q = torch.softmax(base + torch.einsum("cy,cn->ny", w, log_a), -1)
    return q


def rules(p: torch.Tensor, counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every combination of the clients' predictives ``p`` ``(C, n, classes)`` with class counts ``(C, classes)``."""
    c = counts + 0.5
    prior_c = c / c.sum(1, keepdim=True)
    prior = c.sum(0) / c.sum()
    corrected = p * (prior / prior_c)[:, None, :]
    return {
        "average": p.mean(0),
        "prior-corrected average": (corrected / corrected.sum(-1, keepdim=True)).mean(0),
        "geometric": torch.softmax(p.clamp_min(1e-300).log().mean(0), -1),
        "label-shift, equal weights": equal_weight_pool(p, counts, 0.5),
        "label-shift, a_c = 1": label_shift_pool(p, counts, 0.5, iterations=0),
        "label-shift, s = 0.1": label_shift_pool(p, counts, 0.1),
        "label-shift (s = 0.5, the default)": label_shift_pool(p, counts, 0.5),
        "label-shift, s = 2": label_shift_pool(p, counts, 2.0),
        "label-shift, smoothed label priors": smoothed_prior_pool(p, counts, 0.5),
        "label-shift, robust": robust_label_shift_pool(p, counts),
    }


def cell_test_file(grid: Path, counts: list[list[int]]) -> tuple[Path, dict] | None:
    """The partition whose clients have these class counts (its test file and summary); ``None``
    for a cell whose clients are still being fitted."""
    for summary_path in (grid / "partitions").glob("*/summary.json"):
        summary = json.loads(summary_path.read_text())
        if [c["class_counts"] for c in summary["clients"]] == counts:
            return summary_path.parent / "test.h5", summary
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="a `pfuse experiment` output folder (clients/ and partitions/)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    grid = Path(args.grid)
    out = []
    for folder in sorted((grid / "clients").iterdir()):
        paths = sorted(folder.glob("post_*.h5"), key=lambda q: int(q.stem.split("_")[1]))
        if not paths:
            continue
        clients = [posterior_fusion.load(q) for q in paths]
        counts = [list(c.metadata["class_counts"]) for c in clients]
        found = cell_test_file(grid, counts)
        if found is None:
            continue
        test_path, summary = found
        x, y = read_silo(test_path).tensors()
        with torch.no_grad():
            p = torch.stack([c.predict(x, raw=True).double() for c in clients])
        for rule, q in rules(p, torch.tensor(counts, dtype=torch.float64)).items():
            m = classification_metrics(q.float(), y, 15)
            row = {"alpha": summary["alpha"], "seed": summary["partition_seed"], "rule": rule,
                   "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"]}
            out.append(row)
            print(json.dumps(row), flush=True)
    save_rows(args.json, out)
    print(table(out))


def table(rows: list[dict]) -> str:
    """Markdown: per α and rule, accuracy per seed and the means of accuracy, NLL and ECE."""
    lines = ["| α | rule | accuracy % by seed | mean | NLL | ECE |", "|---|---|---|---|---|---|"]
    for alpha in sorted({r["alpha"] for r in rows}, reverse=True):
        for rule in dict.fromkeys(r["rule"] for r in rows):
            cell = sorted((r for r in rows if r["alpha"] == alpha and r["rule"] == rule), key=lambda r: r["seed"])
            n = len(cell)
            seeds = " / ".join(f"{100 * r['accuracy']:.2f}" for r in cell)
            lines.append(f"| {alpha} | {rule} | {seeds} | "
                         f"{100 * sum(r['accuracy'] for r in cell) / n:.2f} | {sum(r['nll'] for r in cell) / n:.3f} | "
                         f"{sum(r['ece'] for r in cell) / n:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
