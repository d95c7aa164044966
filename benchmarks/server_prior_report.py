"""The markdown table of ``server_prior_evidence.py``'s sweeps over seeds: per α, test accuracy % of
fedbens' EM (prior centre clients) at each server λ0 of the grid and at the evidence's λ0, beside the
paper's best-validation iterate; per seed, then mean ± sample std.

    .venv/bin/python benchmarks/server_prior_report.py docs/results/fusion_safety/server_prior/lenet_a*.json

A file's α and seed are read from its name (``lenet_a<α>[_s<seed>].json``).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict


def main() -> None:
    table: dict[str, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for path in sys.argv[1:]:
        m = re.search(r"_a([0-9.]+?)(?:_s(\d+))?(?:_evidence(?:_isotropic)?)?\.json$", path)
        alpha, seed = m.group(1), int(m.group(2) or 0)
        for r in json.load(open(path))["rows"]:
            v = r["variant"]
            key = ("paper: Adam, best validation iterate (validation)" if v.startswith("paper") else
                   "EM, one server λ0 from the evidence (no validation)" if "isotropic" in v else
                   "EM, server λ0 per block from the evidence (no validation)" if "evidence" in v else
                   f"EM, server λ0 = {r['server_prior_precision']:g} (no validation)")
            table[alpha][key][seed] = r
    for alpha, rows in sorted(table.items()):
        seeds = sorted({s for r in rows.values() for s in r})
        print(f"\nα = {alpha}\n")
        print("| fusion | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std | NLL | ECE | val. acc. % |")
        print("|---|" + "---|" * len(seeds) + "---|---|---|---|")

        def order(k: str) -> float:
            return (-1 if k.startswith("paper") else 1e9 if "one server" in k else 2e9 if "evidence" in k
                    else float(k.split("= ")[1].split(" ")[0]))

        for key in sorted(rows, key=order):
            per = rows[key]
            acc = [per[s]["accuracy"] * 100 for s in seeds if s in per]
            cells = []
            for s in seeds:
                if s not in per:
                    cells.append("–")
                    continue
                c = f"{per[s]['accuracy'] * 100:.2f}"
                lam = per[s]["server_prior_precision"]
                if "one server" in key:
                    c += f" (λ0 {lam:.0f})"
                elif "evidence" in key:
                    c += f" (ρ {lam[0] / per[s]['server_prior_search']['block_scales'][0]:.3f})"
                cells.append(c)
            mean = f"{statistics.mean(acc):.2f} ± {statistics.stdev(acc):.2f}" if len(acc) > 1 else f"{acc[0]:.2f}"
            nll = statistics.mean(per[s]["nll"] for s in per)
            ece = statistics.mean(per[s]["ece"] for s in per)
            val = statistics.mean(per[s]["val_accuracy"] * 100 for s in per)
            print(f"| {key} | " + " | ".join(cells) + f" | {mean} | {nll:.3f} | {ece:.3f} | {val:.1f} |")


if __name__ == "__main__":
    main()
