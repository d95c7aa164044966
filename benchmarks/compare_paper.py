"""Row-by-row comparison of an experiment's results with FedBEns Table 1 (FMNIST).

    .venv/bin/python benchmarks/compare_paper.py runs/table1_seed0 > docs/results/table1_vs_paper.md
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

PAPER = {  # FedBEns Table 1, FMNIST, mean of 5 seeds
    "fedbens": {0.05: 59.89, 0.1: 75.91, 0.2: 79.03, 0.4: 84.42},
    "fedfisher": {0.05: 53.92, 0.1: 68.06, 0.2: 72.89, 0.4: 74.76},
    "regmean": {0.05: 48.04, 0.1: 56.40, 0.2: 71.43, 0.4: 74.45},
    "fisher-merge": {0.05: 43.11, 0.1: 57.38, 0.2: 66.89, 0.4: 78.16},
}


def main() -> None:
    work = Path(sys.argv[1])
    rows = [json.loads(Path(p).read_text()) for p in glob.glob(str(work / "results" / "*.json"))]
    alphas = sorted({r["alpha"] for r in rows})
    print("| method (kron, M=5) | " + " | ".join(f"α={a} ours / paper" for a in alphas) + " |")
    print("|---|" + "---|" * len(alphas))
    keys = sorted({(r["method"], r["temperature"]) for r in rows if r["M"] in (5, 1)},
                  key=lambda k: (not k[0].startswith("fedbens"), k[0], k[1] != 0.1, k[1]))
    for method, temp in keys:
        cells = []
        for a in alphas:
            rs = [r for r in rows if r["method"] == method and r["temperature"] == temp and r["alpha"] == a
                  and (r["M"] == 5 or method == "centralized")]
            if not rs:
                cells.append("–")
                continue
            ours = sum(100 * r["accuracy"] for r in rs) / len(rs)
            ref = PAPER.get(method, {}).get(a) if temp == 0.1 else None
            extra = ""
            if method == "fedbens-tuned" and rs[0].get("tuning"):
                t = rs[0]["tuning"]
                extra = f" (T={t['temperature']}, σ0²={t['prior_var']})"
            cells.append(f"{ours:.2f}{extra}" + (f" / {ref:.2f} ({ours - ref:+.2f})" if ref else ""))
        label = method if temp == 0.1 or method in ("centralized", "fedbens-tuned") else f"{method} @ T={temp}"
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\nSeeds per cell: {sorted({r['seed'] for r in rows})}")


if __name__ == "__main__":
    main()
