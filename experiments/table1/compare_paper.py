"""Row-by-row comparison of an experiment's table with FedBEns Tables 1 and 2 (FMNIST, M = 5).

    .venv/bin/python experiments/table1/compare_paper.py runs/table1_reference > docs/results/table1/reference/vs_paper.md

Reads the grid's aggregated ``results.csv`` (mean ± std over the seeds of the current config; the
cache may hold rows of other settings, the table does not) and prints, per structure and method,
ours (mean ± std, seeds) / the paper's mean (difference).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

# FedBEns FMNIST, mean of 5 runs on one partition: (structure, method) -> (clients, α) -> accuracy %.
# Table 1: C = 5, α = 0.05 / 0.1 / 0.2 / 0.4; Table 2: α = 0.3, C = 10 / 20 / 40.
PAPER = {
    ("kron", "fedbens"): {(5, 0.05): 59.89, (5, 0.1): 75.91, (5, 0.2): 79.03, (5, 0.4): 84.42,
                          (10, 0.3): 80.57, (20, 0.3): 80.83, (40, 0.3): 77.27},
    ("diag+full", "fedbens"): {(5, 0.05): 55.58, (5, 0.1): 70.04, (5, 0.2): 77.24, (5, 0.4): 81.81,
                               (10, 0.3): 78.66, (20, 0.3): 76.16, (40, 0.3): 72.69},
    ("kron", "fedfisher"): {(5, 0.05): 53.92, (5, 0.1): 68.06, (5, 0.2): 72.89, (5, 0.4): 74.76,
                            (10, 0.3): 73.85, (20, 0.3): 72.83, (40, 0.3): 72.06},
    ("kron", "regmean"): {(5, 0.05): 48.04, (5, 0.1): 56.40, (5, 0.2): 71.43, (5, 0.4): 74.45,
                          (10, 0.3): 73.97, (20, 0.3): 72.91, (40, 0.3): 72.09},
    ("kron", "fisher-merge"): {(5, 0.05): 43.11, (5, 0.1): 57.38, (5, 0.2): 66.89, (5, 0.4): 78.16,
                               (10, 0.3): 66.84, (20, 0.3): 64.11, (40, 0.3): 64.29},
}
ORDER = ["fedbens", "fedbens-tuned", "fedfisher", "regmean", "fisher-merge", "fedavg", "ensemble", "centralized"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path, help="the grid's output folder (holds results.csv)")
    work = ap.parse_args().work
    with open(work / "results.csv") as fh:
        agg = [r for r in csv.DictReader(fh) if r["M"] in ("5", "1") and r["temperature"] == "0.1"]
    axes = sorted({(int(r["clients"]), float(r["alpha"])) for r in agg})
    print("| structure | method | " + " | ".join(f"C={c}, α={a} ours / paper" for c, a in axes) + " |")
    print("|---|---|" + "---|" * len(axes))
    keys = sorted({(r["structure"], r["method"]) for r in agg},
                  key=lambda k: (k[0] == "-", k[0], ORDER.index(k[1]) if k[1] in ORDER else 99, k[1]))
    for structure, method in keys:
        cells = []
        for c, a in axes:
            rs = [r for r in agg if (r["structure"], r["method"]) == (structure, method) and float(r["alpha"]) == a
                  and int(r["clients"]) == c]
            if not rs:
                cells.append("–")
                continue
            r = rs[0]
            ours = float(r["accuracy_mean"])
            ref = PAPER.get((structure, method), {}).get((c, a))
            cells.append(f"{ours:.2f} ± {float(r['accuracy_std']):.2f} ({r['seeds']})"
                         + (f" / {ref:.2f} ({ours - ref:+.2f})" if ref is not None else ""))
        print(f"| {structure} | {method} | " + " | ".join(cells) + " |")
    print("\nCells: mean ± std over seeds (number of seeds) / the paper's mean (ours − paper). The paper reports "
          "no plain-diagonal FedBEns; its baselines use K-FAC (FedFisher) or their own curvature, compared here "
          "with our kron artifacts.")


if __name__ == "__main__":
    main()
