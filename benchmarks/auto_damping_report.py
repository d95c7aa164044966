"""Markdown table of ``refresh_damping_sweep.py --ratios`` outputs (issue 29: the refresh centre's damping
chosen by the silos' gain ratio): per client set, test accuracy of the refit at each fixed damping d with
the smallest and median gain ratio over the components, and the ``auto`` row (its chosen d's).

    .venv/bin/python benchmarks/auto_damping_report.py docs/results/fusion_safety/auto_damping/*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path


def main() -> None:
    files = [Path(f) for f in sys.argv[1:]]
    dampings = sorted({r["damping"] for f in files for r in json.loads(f.read_text())["rows"] if r["damping"] != "auto"})
    print("| client set | " + " | ".join(f"d = {d:g}" for d in dampings) + " | auto | auto's d (components) |")
    print("|---|" + "---|" * (len(dampings) + 2))
    for f in files:
        rows = {r["damping"]: r for r in json.loads(f.read_text())["rows"]}
        best = max((r["accuracy"] for d, r in rows.items() if d != "auto"), default=None)
        auto = rows.get("auto")
        chosen = ", ".join(f"{d:g} × {n}" for d, n in sorted(Counter(auto["chosen_dampings"]).items())) if auto else "–"
        cells = [cell(rows.get(d), best) for d in dampings] + [cell(auto, best)]
        print(f"| {f.stem} | " + " | ".join(cells) + f" | {chosen} |")


def cell(row: dict | None, best: float | None) -> str:
    """Accuracy % (bold: the best fixed d) with the smallest / median gain ratio of the components."""
    if row is None:
        return "–"
    acc = f"{100 * row['accuracy']:.2f}"
    acc = f"**{acc}**" if row["accuracy"] == best else acc
    ratios = row.get("step_ratios") or []
    return f"{acc} (ρ {min(ratios):.2f} / {statistics.median(ratios):.2f})" if ratios else acc


if __name__ == "__main__":
    main()
