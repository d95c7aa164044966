"""The markdown table of ``variant_table.py``'s rows over seeds: mean ± sample std (over the
seeds present) of accuracy, NLL, ECE, OOD AUROC, server seconds, evaluation seconds and peak MiB per
(variant, predictive), one table per α.

    .venv/bin/python experiments/without_validation/variant_report.py docs/results/without_validation/variants/lenet_a0.1*.json \
        docs/results/without_validation/variants/lenet_a0.4*.json > table.md

A file's α is read from its name (``lenet_a<α>[_s<seed>].json``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict


def cell(values: list[float], digits: int, scale: float = 1.0) -> str:
    vals = [v * scale for v in values if v is not None]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.mean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def main() -> None:
    by_alpha: dict[str, dict[tuple[str, str], list[dict]]] = defaultdict(lambda: defaultdict(list))
    seeds: dict[str, int] = defaultdict(int)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="variant_table.py outputs, named lenet_a<α>[_s<seed>].json")
    for path in ap.parse_args().files:
        alpha = re.search(r"_a([0-9.]+?)(?:_s\d+)?\.json$", path).group(1)
        seeds[alpha] += 1
        for r in json.load(open(path))["rows"]:
            by_alpha[alpha][r["variant"], r["predictive"]].append(r)
    for alpha, groups in by_alpha.items():
        print(f"\nα = {alpha} ({seeds[alpha]} partition seeds)\n")
        print("| fusion | validation | predictive | members | accuracy % | NLL | ECE | OOD AUROC | server s | eval s | eval peak MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for (variant, predictive), rows in groups.items():
            get = lambda k, rows=rows: [r[k] for r in rows]  # noqa: E731
            print(f"| {variant} | {'yes' if rows[0]['validation'] else 'no'} | {predictive} | {rows[0]['members']} "
                  f"| {cell(get('accuracy'), 2, 100)} | {cell(get('nll'), 3)} | {cell(get('ece'), 3)} "
                  f"| {cell(get('ood_auroc'), 3)} | {cell(get('server_seconds'), 1)} | {cell(get('eval_seconds'), 1)} "
                  f"| {cell(get('eval_peak_mib'), 0)} |")


if __name__ == "__main__":
    main()
