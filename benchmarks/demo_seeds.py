"""Is the default demo representative? ``pfuse demo``'s defaults over partition seeds 0, 1, 2, and
its ranking of methods against the full-data table (docs/results/table1_seeds12, α = 0.1).

    nice -n 19 .venv/bin/python benchmarks/demo_seeds.py --out runs/demo_seeds --seeds 0,1,2

Writes ``<out>/demo_seeds.json`` and prints per-seed accuracy/NLL/ECE and wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from posterior_fusion.demo import run_demo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    path = out / "demo_seeds.json"
    if path.exists():
        results = json.loads(path.read_text())
    for seed in (int(s) for s in args.seeds.split(",")):
        if str(seed) in results:
            continue
        t0 = time.perf_counter()
        rows = run_demo(out / f"seed{seed}", seed=seed, log=lambda m: print(m, flush=True))
        results[str(seed)] = {"wall_seconds": round(time.perf_counter() - t0, 1), "rows": rows}
        path.write_text(json.dumps(results, indent=1))
        print(f"seed {seed}: " + ", ".join(f"{r['method']} {r['accuracy']:.4f}" for r in rows)
              + f" ({results[str(seed)]['wall_seconds']}s)", flush=True)


if __name__ == "__main__":
    main()
