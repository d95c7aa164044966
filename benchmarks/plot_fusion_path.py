"""Figures for issue 29, item 1: from ``fusion_path.py --exact-ggn`` JSON files (one per α), along
fedbens' path (Adam stopped after 0 … 1,000 steps, then EM to stationarity): test accuracy and NLL,
and per client the per-sample NLL increase its K-FAC quadratic predicts, the exact-GGN quadratic
predicts, and the increase measured on its own data.

    .venv/bin/python benchmarks/plot_fusion_path.py OUT.png path_a0.1.json path_a0.4.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, files = sys.argv[1], sys.argv[2:]
    fig, axes = plt.subplots(len(files), 2, figsize=(11, 3.6 * len(files)), squeeze=False)
    for row, f in zip(axes, files):
        rows = json.loads(Path(f).read_text())["rows"]
        labels = [r["variant"].replace(" steps", "").replace("adam ", "adam\n").replace(" (stationary)", "")
                  .replace(", damping ", "\nd=") for r in rows]
        xs = range(len(rows))
        ax = row[0]
        ax.plot(xs, [100 * r["accuracy"] for r in rows], "o-", label="test accuracy %")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("accuracy %")
        ax2 = ax.twinx()
        ax2.plot(xs, [r["nll"] for r in rows], "s--", color="tab:red", label="test NLL")
        ax2.set_ylabel("NLL", color="tab:red")
        ax.set_title(f"{Path(f).stem}: fused modes along the path")
        ax = row[1]
        for key, style, name in (("actual_nll_increase", "o-", "measured"),
                                 ("exact_ggn_predicted_nll_increase", "^--", "exact GGN quadratic"),
                                 ("predicted_nll_increase", "s:", "K-FAC quadratic")):
            if key not in rows[0]["clients"][0]:
                continue
            mean = [sum(c[key] for c in r["clients"]) / len(r["clients"]) for r in rows]
            ax.plot(xs, mean, style, label=name)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("per-sample NLL increase on own data\n(mean over clients)")
        ax.set_title("clients' quadratics vs their data at the fused modes")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
