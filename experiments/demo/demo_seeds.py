"""Is the default demo representative? ``pfuse demo``'s defaults over partition seeds 0, 1, 2, and
its ranking of methods against the full-data table (docs/results/table1_seeds12, α = 0.1).

    nice -n 19 .venv/bin/python experiments/demo/demo_seeds.py --out runs/demo_seeds --seeds 0,1,2

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
    ap.add_argument("--report", default=None, help="write a markdown report here from the finished seeds")
    args = ap.parse_args()
    if args.report:
        report(Path(args.out) / "demo_seeds.json", Path(args.report))
        return
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


def full_data_reference() -> dict[str, tuple[float, int]]:
    """Mean test accuracy (%) at α = 0.1, kron, M = 5 over the three seeds of docs/results
    (seed 0 from table1_seed0, seeds 1-2 from table1_seeds12), per method."""
    import csv

    root = Path(__file__).resolve().parents[1] / "docs" / "results"
    acc: dict[str, list[tuple[float, int]]] = {}
    for name in ("table1_seed0", "table1_seeds12"):
        with open(root / name / "results.csv") as f:
            for row in csv.DictReader(f):
                if row["alpha"] == "0.1" and row["structure"] == "kron" and row["M"] == "5" and row["temperature"] == "0.1":
                    acc.setdefault(row["method"], []).append((float(row["accuracy_mean"]), int(row["seeds"])))
    return {m: (sum(a * n for a, n in v) / sum(n for _, n in v), sum(n for _, n in v)) for m, v in acc.items()}


def report(results_path: Path, out: Path) -> None:
    import statistics

    results = json.loads(results_path.read_text())
    seeds = sorted(results, key=int)
    methods = [r["method"] for r in results[seeds[0]]["rows"]]
    ref = full_data_reference()
    lines = ["# Is the default demo representative?", "",
             "`pfuse demo` with its defaults (the installed full Fashion-MNIST, 5 clients, α = 0.1, M = 3, 5 epochs,",
             "kron, 300 server steps) for partition seeds " + ", ".join(seeds) + ":", "",
             "    nice -n 10 .venv/bin/python experiments/demo/demo_seeds.py --out runs/demo_seeds --seeds 0,1,2",
             "    .venv/bin/python experiments/demo/demo_seeds.py --out runs/demo_seeds --report docs/results/demo/results.md",
             "", "| method | members | " + " | ".join(f"seed {s}" for s in seeds)
             + " | mean ± std | NLL | ECE | full data, α = 0.1, M = 5, 20 epochs (3 seeds) |",
             "|---|---|" + "---|" * len(seeds) + "---|---|---|---|"]
    for m in methods:
        rows = [next(r for r in results[s]["rows"] if r["method"] == m) for s in seeds]
        acc = [100 * r["accuracy"] for r in rows]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        nll = statistics.mean(r["nll"] for r in rows)
        ece = statistics.mean(r["ece"] for r in rows)
        full = (f"{ref[m][0]:.2f}" + ("" if ref[m][1] == 3 else f" ({ref[m][1]} seeds)")) if m in ref else "–"
        lines.append(f"| {m} | {rows[0]['members']} | " + " | ".join(f"{a:.2f}" for a in acc)
                     + f" | {statistics.mean(acc):.2f} ± {sd:.2f} | {nll:.3f} | {ece:.3f} | {full} |")
    lines += ["", "Ranking of the methods the full-data tables have, per seed (best first):", ""]
    shared = [m for m in methods if m in ref]
    want = sorted(shared, key=lambda m: -ref[m][0])
    lines.append(f"- full data: {' > '.join(want)}")
    for s in seeds:
        acc = {r["method"]: r["accuracy"] for r in results[s]["rows"]}
        got = sorted(shared, key=lambda m: -acc[m])
        lines.append(f"- demo seed {s}: {' > '.join(got)}" + ("  (same order)" if got == want else ""))
    lines += ["", "Wall time per seed (2 cores shared with a background grid and the test suite): "
              + ", ".join(f"{results[s]['wall_seconds']:.0f} s" for s in seeds) + "."]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
