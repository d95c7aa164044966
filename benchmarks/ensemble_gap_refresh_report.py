"""Markdown table of ``ensemble_gap_refresh.sh``'s evaluations: per global artifact (the client ensemble,
the one-shot anchor, each refresh round's refit), accuracy / NLL / ECE per seed and their mean ± std.

    .venv/bin/python benchmarks/ensemble_gap_refresh_report.py docs/results/ensemble_gap/refresh a0.4
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

LABELS = {"ens": "client ensemble", "anchor": "fedbens-clients, prior centre (one-shot; the grid's best)",
          "refit_adam": "… + one refresh round (damping auto), refit"}


def label(name: str) -> str:
    m = re.fullmatch(r"refit(\d+)_adam", name)
    return LABELS.get(name) or (f"… + {m.group(1)} refresh rounds, refit" if m else name)


def rounds(name: str) -> int:
    """Table order: the ensemble, the anchor, then the refits by their number of rounds."""
    m = re.fullmatch(r"refit(\d*)_adam", name)
    return {"ens": -2, "anchor": -1}.get(name, int(m.group(1) or 1) if m else 99)


def main() -> None:
    folder, alpha = Path(sys.argv[1]), sys.argv[2]
    table: dict[str, dict[int, dict]] = {}
    for f in sorted(folder.glob(f"eval_a{alpha}_s*_*.json")):
        m = re.fullmatch(rf"eval_a{re.escape(alpha)}_s(\d+)_(.+)\.json", f.name)
        rows = json.loads(f.read_text())
        row = rows[0] if isinstance(rows, list) else rows
        table.setdefault(m.group(2), {})[int(m.group(1))] = row
    seeds = sorted({s for v in table.values() for s in v})
    print("| global (25 networks) | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std | NLL | ECE |")
    print("|---|" + "---|" * (len(seeds) + 3))
    for name in sorted(table, key=rounds):
        by = table[name]
        accs = [100 * by[s]["accuracy"] for s in seeds if s in by]
        mean = f"{statistics.mean(accs):.2f}" + (f" ± {statistics.stdev(accs):.2f}" if len(accs) > 1 else "")
        mean += "" if len(accs) == len(seeds) else f" ({len(accs)} of {len(seeds)} seeds)"
        nll = statistics.mean(by[s]["nll"] for s in by)
        ece = statistics.mean(by[s]["ece"] for s in by)
        cells = [f"{100 * by[s]['accuracy']:.2f}" if s in by else "–" for s in seeds]
        print(f"| {label(name)} | " + " | ".join(cells) + f" | {mean} | {nll:.3f} | {ece:.3f} |")


if __name__ == "__main__":
    main()
