"""Row-by-row comparison of an experiment's table with FedBEns Table 1 (FMNIST, 5 clients, M = 5).

    .venv/bin/python benchmarks/compare_paper.py runs/table1_reference > docs/results/table1_reference/vs_paper.md

Reads the grid's aggregated ``results.csv`` (mean ± std over the seeds of the current config; the
cache may hold rows of other settings, the table does not) and prints, per structure and method,
ours (mean ± std, seeds) / the paper's mean (difference).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

PAPER = {  # FedBEns Table 1, FMNIST, mean of 5 runs on one partition; (structure, method) -> α -> accuracy %
    ("kron", "fedbens"): {0.05: 59.89, 0.1: 75.91, 0.2: 79.03, 0.4: 84.42},
    ("diag+full", "fedbens"): {0.05: 55.58, 0.1: 70.04, 0.2: 77.24, 0.4: 81.81},
    ("kron", "fedfisher"): {0.05: 53.92, 0.1: 68.06, 0.2: 72.89, 0.4: 74.76},
    ("kron", "regmean"): {0.05: 48.04, 0.1: 56.40, 0.2: 71.43, 0.4: 74.45},
    ("kron", "fisher-merge"): {0.05: 43.11, 0.1: 57.38, 0.2: 66.89, 0.4: 78.16},
}
ORDER = ["fedbens", "fedbens-tuned", "fedfisher", "regmean", "fisher-merge", "fedavg", "ensemble", "centralized"]


def main() -> None:
    work = Path(sys.argv[1])
    with open(work / "results.csv") as fh:
        agg = [r for r in csv.DictReader(fh) if r["M"] in ("5", "1") and r["temperature"] == "0.1"]
    alphas = sorted({float(r["alpha"]) for r in agg})
    print("| structure | method | " + " | ".join(f"α={a} ours / paper" for a in alphas) + " |")
    print("|---|---|" + "---|" * len(alphas))
    keys = sorted({(r["structure"], r["method"]) for r in agg},
                  key=lambda k: (k[0] == "-", k[0], ORDER.index(k[1]) if k[1] in ORDER else 99, k[1]))
    for structure, method in keys:
        cells = []
        for a in alphas:
            rs = [r for r in agg if (r["structure"], r["method"]) == (structure, method) and float(r["alpha"]) == a]
            if not rs:
                cells.append("–")
                continue
            r = rs[0]
            ours = float(r["accuracy_mean"])
            ref = PAPER.get((structure, method), {}).get(a)
            cells.append(f"{ours:.2f} ± {float(r['accuracy_std']):.2f} ({r['seeds']})"
                         + (f" / {ref:.2f} ({ours - ref:+.2f})" if ref is not None else ""))
        print(f"| {structure} | {method} | " + " | ".join(cells) + " |")
    print("\nCells: mean ± std over seeds (number of seeds) / the paper's mean (ours − paper). The paper reports "
          "no plain-diagonal FedBEns; its baselines use K-FAC (FedFisher) or their own curvature, compared here "
          "with our kron artifacts.")


if __name__ == "__main__":
    main()
