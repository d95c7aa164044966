"""Markdown summary of ``fusion_path.py --exact-ggn`` over partition seeds (issue 29, item 1): per α and
path point, test accuracy (mean ± std over seeds) and, over every client of every seed, the range of the
per-sample NLL increase that its K-FAC quadratic and its exact-GGN quadratic predict against the one
measured on its data, with the median ratio measured ÷ exact.

    .venv/bin/python benchmarks/fusion_path_report.py docs/results/fusion_safety/path_exact_lenet_a0.1*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    runs = [json.loads(Path(f).read_text())["rows"] for f in sys.argv[1:]]
    print(f"| path point | accuracy % ({len(runs)} seeds) | K-FAC predicts | exact GGN predicts | measured | measured ÷ exact, median |")
    print("|---|---|---|---|---|---|")
    for k, first in enumerate(runs[0]):
        rows = [r[k] for r in runs]
        if any(r["variant"] != first["variant"] for r in rows):
            raise SystemExit("the files list their path points in different orders")
        acc = [100 * r["accuracy"] for r in rows]
        clients = [c for r in rows for c in r["clients"]]

        ratio = statistics.median(c["actual_nll_increase"] / c["exact_ggn_predicted_nll_increase"] for c in clients
                                  if c["exact_ggn_predicted_nll_increase"] > 0)
        spread = f" ± {statistics.stdev(acc):.2f}" if len(acc) > 1 else ""
        print(f"| {first['variant']} | {statistics.mean(acc):.2f}{spread} | {span(clients, 'predicted_nll_increase')} | "
              f"{span(clients, 'exact_ggn_predicted_nll_increase')} | {span(clients, 'actual_nll_increase')} | {ratio:.1f}× |")


def span(clients: list[dict], key: str) -> str:
    """``min–max`` of one per-client field."""
    values = [c[key] for c in clients]
    return f"{min(values):.2f}–{max(values):.2f}"


if __name__ == "__main__":
    main()
