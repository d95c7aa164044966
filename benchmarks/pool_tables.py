"""Pool the aggregated tables of grids that ran the same settings on different seeds.

    .venv/bin/python benchmarks/pool_tables.py docs/results/table1_seed0 docs/results/table1_seeds12 \
        --out docs/results/table1_ours_pooled
    .venv/bin/python benchmarks/compare_paper.py docs/results/table1_ours_pooled > docs/results/table1_ours_pooled/vs_paper.md

Each input folder's ``results.csv`` (mean, std and number of seeds per row) is combined exactly:
N = Σ n_i, mean = Σ n_i m_i / N, (N − 1) sd² = Σ (n_i − 1) s_i² + n_i (m_i − mean)². Rows are keyed by
structure, M, method, temperature, α and clients; the output has the grid's ``results.csv`` columns.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

KEY = ("structure", "M", "method", "temperature", "alpha", "clients")


def pooled(rows: list[dict]) -> dict:
    n = [int(r["seeds"]) for r in rows]
    m = [float(r["accuracy_mean"]) for r in rows]
    s = [float(r["accuracy_std"]) for r in rows]
    total = sum(n)
    mean = sum(ni * mi for ni, mi in zip(n, m)) / total
    ss = sum((ni - 1) * si**2 + ni * (mi - mean) ** 2 for ni, mi, si in zip(n, m, s))
    out = {k: rows[0][k] for k in KEY}

    def weighted(col: str) -> float | str:
        vals = [(ni, r.get(col)) for ni, r in zip(n, rows)]
        if any(v in (None, "", "nan") for _, v in vals):
            return ""
        return round(sum(ni * float(v) for ni, v in vals) / total, 4)

    out.update(seeds=total, accuracy_mean=round(mean, 2),
               accuracy_std=round(math.sqrt(ss / (total - 1)), 2) if total > 1 else 0.0,
               nll_mean=weighted("nll_mean"), ece_mean=weighted("ece_mean"), members=rows[0].get("members", ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="grid output folders holding results.csv")
    ap.add_argument("--out", required=True, help="folder for the pooled results.csv")
    args = ap.parse_args()
    groups: dict[tuple, list[dict]] = {}
    for folder in args.folders:
        with open(Path(folder) / "results.csv") as fh:
            for r in csv.DictReader(fh):
                groups.setdefault(tuple(r[k] for k in KEY), []).append(r)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [pooled(rs) for _, rs in sorted(groups.items())]
    with open(out / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"pooled {len(rows)} rows from {len(args.folders)} tables into {out / 'results.csv'}")


if __name__ == "__main__":
    main()
