"""The table of ``experiments/distillation/README.md`` from the committed cell results.

    .venv/bin/python experiments/distillation/report.py docs/results/distillation
    .venv/bin/python experiments/distillation/report.py docs/results/distillation_pretrained_base/all --alphas 0.1 0.4

Rows: the client ensemble and the pool (the teacher) and FedBE's recipe (``swa``: the label-shift-pool grid's
rows on the same networks, per seed) and every recipe / lever measured here; columns α; each cell the mean test accuracy over the seeds
measured (their number in brackets), NLL / ECE, the mean difference to the pool on the same seeds, the student's
agreement with the teacher on held-out inputs and the server's minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ALPHAS = (0.1, 0.2, 0.4)
LABELS = {"ensemble": "client ensemble (C·M networks, averaged)", "pool": "label-shift pool (the teacher, C·M networks)",
          "swa": "FedBE's recipe (`swa`), 5,000 inputs",
          "consistent-5000": "consistent, 5,000 inputs", "consistent-500": "consistent, 500 inputs",
          "data-free": "data-free (no server inputs)",
          "consistent-5000+views8": "consistent, 5,000 inputs, 8 cached views each (`--distill-views 8`)",
          "consistent-5000+cutmix": "… and CutMix or mixup per batch (`--distill-cutmix 1`)",
          "consistent-5000+views8-long": "… and 12,000 steps, the clients' LeNet",
          "consistent-5000+wide2": "… a LeNet twice as wide, from scratch, 3,000 steps (`--distill-student`)",
          "consistent-5000+wide2-long": "… a LeNet twice as wide, from scratch, 12,000 steps",
          "data-free+views8": "data-free, 8 cached views",
          "data-free+all-layers": "… matching every layer's recorded factor (`--distill-moment-layers all`)",
          "data-free+all-layers-500": "… and 500 synthesised inputs instead of 5,000 (`--distill-synth-size 500`)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", type=Path, help="a folder of cell results (<α>_<seed>_<row>.json)")
    ap.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS), help="the columns [default: 0.1 0.2 0.4]")
    args = ap.parse_args()
    alphas = tuple(args.alphas)
    rows: dict[str, dict[float, list[dict]]] = {}
    for path in sorted(args.cells.glob("*.json")):
        r = json.loads(path.read_text())
        rows.setdefault(r["row"], {}).setdefault(r["alpha"], []).append(r)
    print("| one network (or the teacher) | " + " | ".join(f"α = {a}" for a in alphas) + " |")
    print("|---|" + "---|" * len(alphas))
    order = [k for k in LABELS if k in rows] + sorted(k for k in rows if k not in LABELS)
    for key in order:
        cells = []
        for a in alphas:
            got = rows[key].get(a, [])
            if not got:
                cells.append("–")
                continue
            acc = [100 * r["accuracy"] for r in got]
            std = statistics.stdev(acc) if len(acc) > 1 else 0.0
            agree = [r["agreement"] for r in got if r.get("agreement") is not None]
            minutes = statistics.mean(r["server_seconds"] for r in got) / 60
            pool = {r["seed"]: r["accuracy"] for r in rows.get("pool", {}).get(a, [])}
            gaps = [100 * (r["accuracy"] - pool[r["seed"]]) for r in got if r["seed"] in pool]
            gap = f" · {statistics.mean(gaps):+.2f} vs the pool" if gaps and key != "pool" else ""
            extra = gap + (f" · agreement {statistics.mean(agree):.3f} · {minutes:.1f} min" if agree else "")
            cells.append(f"{statistics.mean(acc):.2f} ± {std:.2f} ({len(acc)}) · "
                         f"{statistics.mean(r['nll'] for r in got):.3f} / {statistics.mean(r['ece'] for r in got):.3f}"
                         + extra)
        print(f"| {LABELS.get(key, key)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
