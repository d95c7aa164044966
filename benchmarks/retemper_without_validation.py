"""Server-side tempering of the client posteriors under fedbens' default without validation data (issue 29, item 2:
"candidates to measure side by side — … server-side tempering of the client posteriors"), on ``pfuse demo`` folders.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/retemper_without_validation.py /tmp/s25/a0.1_s3 \\
        --json docs/results/fusion_safety/retemper_s25/a0.1_s3.json
    .venv/bin/python benchmarks/retemper_without_validation.py --report docs/results/fusion_safety/retemper_s25/*.json

Per folder: the default fusion without validation data (``solver=auto``: EM, prior centre clients, server prior from
the evidence) with every client re-tempered to T (``fuse --temperature T``; ``None``: the clients' own T), beside the
paper's Adam with its best validation iterate at the clients' T (the goal's reference); each evaluated with the
``map`` predictive on the folder's test split. One JSON per folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.metrics import evaluate_members

TEMPERATURES = (None, 0.03, 0.3, 1.0)  # None: the clients' own T (0.1 in the demo)
REFERENCE = "adam, best validation iterate, clients' T"


def run(folder: Path) -> dict:
    posts = sorted(folder.glob("post_*.h5"))
    val, test = folder / "data" / "server_val.h5", read_silo(folder / "data" / "test.h5")
    rows = []
    cases = [(f"default, no validation, T = {'clients' if t is None else t}", t, {}, None) for t in TEMPERATURES]
    cases.append((REFERENCE, None, {"solver": "adam"}, val))
    for label, temperature, settings, val_path in cases:
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inputs, result, meta = fuse(posts, "fedbens", FusionOptions(progress=False, temperature=temperature),
                                        {**settings, "laplace": False}, val_path=val_path)
        seconds = time.perf_counter() - t0
        metrics = evaluate_members(inputs.spec, result.members, test)
        rows.append({"label": label, "temperature": temperature, "resolved": meta["resolved"],
                     "fuse_seconds": round(seconds, 2), "accuracy": metrics["accuracy"], "nll": metrics["nll"],
                     "ece": metrics["ece"], "warnings": sorted({str(w.message)[:160] for w in caught})})
        print(f"{folder.name}: {label}: {100 * metrics['accuracy']:.2f} % NLL {metrics['nll']:.3f} "
              f"ECE {metrics['ece']:.3f} ({seconds:.1f} s)", flush=True)
    return {"folder": str(folder), "torch_threads": torch.get_num_threads(), "rows": rows}


def report(paths: list[str]) -> None:
    """Markdown: per row and α, accuracy per seed, mean ± std, the mean difference to the reference, NLL / ECE."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    alphas = sorted({Path(r["folder"]).name.split("_")[0] for r in runs})
    print("| fusion | " + " | ".join(f"α = {a[1:]} accuracy % (seeds) | mean ± std | − reference | NLL / ECE"
                                       for a in alphas) + " |")
    print("|---|" + "---|---|---|---|" * len(alphas))
    for label in [r["label"] for r in runs[0]["rows"]]:
        cells = []
        for a in alphas:
            mine = sorted((r for r in runs if Path(r["folder"]).name.split("_")[0] == a), key=lambda r: r["folder"])
            got = [next(row for row in r["rows"] if row["label"] == label) for r in mine]
            ref = [next(row for row in r["rows"] if row["label"] == REFERENCE) for r in mine]
            acc = [100 * row["accuracy"] for row in got]
            diff = [100 * (g["accuracy"] - f["accuracy"]) for g, f in zip(got, ref)]
            sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
            cells += [" / ".join(f"{v:.2f}" for v in acc), f"{statistics.mean(acc):.2f} ± {sd:.2f}",
                      f"{statistics.mean(diff):+.2f}",
                      f"{statistics.mean(row['nll'] for row in got):.3f} / {statistics.mean(row['ece'] for row in got):.3f}"]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", help="pfuse demo output folders (post_*.h5, data/server_val.h5, data/test.h5)")
    ap.add_argument("--json", help="write the folder's rows here (one folder)")
    ap.add_argument("--report", nargs="+", help="JSON files of earlier runs: print the markdown table")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return
    for folder in args.folders:
        out = run(Path(folder))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
