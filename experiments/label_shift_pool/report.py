"""The per-seed table of `docs/results/label_shift_pool/README.md` from a grid's cached rows.

    .venv/bin/python experiments/label_shift_pool/report.py runs/label_shift_pool
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

LABELS = {"ensemble": "average (the client ensemble)", "ensemble-label-shift": "**label-shift**",
          "ensemble+distill": "average, distilled", "ensemble-label-shift+distill": "label-shift, distilled"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path, help="the grid's output folder (holds results/*.json)")
    rows = [json.loads(p.read_text()) for p in sorted((ap.parse_args().work / "results").glob("*.json"))]
    for alpha in sorted({r["alpha"] for r in rows}, reverse=True):
        for method, label in LABELS.items():
            cell = sorted((r for r in rows if r["alpha"] == alpha and r["method"] == method), key=lambda r: r["seed"])
            if not cell:
                continue
            acc = [100 * r["accuracy"] for r in cell]
            std = statistics.stdev(acc) if len(acc) > 1 else 0.0
            print(f"| {alpha} | {label} | {' / '.join(f'{a:.2f}' for a in acc)} | {statistics.mean(acc):.2f} ± {std:.2f}"
                  f" ({len(acc)}) | {statistics.mean(r['nll'] for r in cell):.3f} | "
                  f"{statistics.mean(r['ece'] for r in cell):.3f} | {cell[0]['members']} |")


if __name__ == "__main__":
    main()
