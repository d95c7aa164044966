"""Markdown table of ``mode_calibration.py`` outputs: per client set, the mixture of modes and the single
modes (mean over the modes), each with `map`, `glm` at the server's λ0 and `glm` at the evidence's δ —
NLL, ECE and confidence − accuracy (negative: underconfident) — and how many single modes the evidence's
`glm` beats on NLL *and* ECE.

    .venv/bin/python benchmarks/mode_calibration_report.py docs/results/fusion_safety/evidence/mode_calibration_*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

CASES = (("map", "-"), ("glm", "server"), ("glm", "evidence"))


def main() -> None:
    print("| client set | scope | δ (evidence) | map NLL / ECE / conf − acc | glm at λ0 | glm at δ | modes where glm at δ beats map on NLL and ECE |")
    print("|---|---|---|---|---|---|---|")
    for f in sys.argv[1:]:
        rows = json.loads(Path(f).read_text())["rows"]
        name = Path(f).stem.replace("mode_calibration_", "")
        pick = {(r["scope"], r["predictive"], r["prior"]): r for r in rows}
        modes = sorted({r["scope"] for r in rows if r["scope"] != "mixture"})
        wins = sum(pick[(m, "glm", "evidence")]["nll"] < pick[(m, "map", "-")]["nll"]
                   and pick[(m, "glm", "evidence")]["ece"] < pick[(m, "map", "-")]["ece"] for m in modes)
        for scope, members in (("mixture", ["mixture"]), ("single mode (mean)", modes)):
            cells = []
            for case in CASES:
                rs = [pick[(m, *case)] for m in members]
                cells.append(" / ".join(f"{statistics.mean(x):.3f}" for x in (
                    [r["nll"] for r in rs], [r["ece"] for r in rs], [r["confidence"] - r["accuracy"] for r in rs])))
            delta = statistics.mean(pick[(m, "glm", "evidence")]["prior_precision"] for m in members)
            won = f"{wins} of {len(modes)}" if scope != "mixture" else "–"
            print(f"| {name} | {scope} | {delta:.1f} | " + " | ".join(cells) + f" | {won} |")


if __name__ == "__main__":
    main()
