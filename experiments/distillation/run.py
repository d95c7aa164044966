"""One network taught what the label-shift pool knows: the distillation recipes on the label-shift-pool study's
clients (``experiments/label_shift_pool/``, its grid's cache), each cell through the CLI.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/distillation/run.py runs/label_shift_pool \\
        --alphas 0.1 --seeds 0 --rows consistent-5000 consistent-500 data-free --out docs/results/distillation

Rows: ``pool`` (the teacher: the clients' 25 networks pooled under label shift), ``ensemble`` (the plain client
ensemble), ``swa`` (FedBE's recipe on the 5,000 images, for clients no grid trained), ``consistent-5000`` and
``consistent-500`` (the consistent recipe on 5,000 or the first 500 of the grid's unlabeled server images),
``data-free`` (no server inputs: synthesised from the teachers and the clients' first-layer input factors),
``plain-teacher`` (the consistent recipe on the 5,000 images, taught by the plain client ensemble instead).
FedBE's recipe is also the grid's own ``ensemble-label-shift+distill`` row. Each cell writes
``OUT/<alpha>_<seed>_<row>.json`` (accuracy, NLL, ECE, agreement, server seconds) and is skipped when present.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import posterior_fusion
from posterior_fusion.data.silo import SiloData, write_silo

PFUSE = str(Path(sys.executable).parent / "pfuse")
LEVERED = ("consistent-5000", "consistent-500", "data-free", "plain-teacher")  # the rows a lever's options change
ROWS = ("pool", "ensemble", "swa", *LEVERED)


def cells(work: Path) -> dict[tuple[float, int], tuple[list[Path], Path]]:
    """(alpha, seed) -> (the five client artifacts, the partition folder), matched by the clients' class counts."""
    out = {}
    for summary in (work / "partitions").glob("*/summary.json"):
        s = json.loads(summary.read_text())
        counts = [c["class_counts"] for c in s["clients"]]
        for folder in (work / "clients").iterdir():
            posts = sorted(folder.glob("post_*.h5"), key=lambda p: int(p.stem.split("_")[1]))
            if len(posts) != len(counts):
                continue
            head = posterior_fusion.load(posts[0])
            if list(head.metadata["class_counts"]) == counts[0] and head.structure == "kron":
                out[(s["alpha"], s["partition_seed"])] = (posts, summary.parent)
    return out


def run(*args: str) -> str:
    r = subprocess.run([PFUSE, "-q", *map(str, args)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"pfuse {' '.join(map(str, args))}: {r.stderr.strip()}")
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path, help="the label-shift-pool grid's folder (runs/label_shift_pool)")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--steps", type=int, default=3000, help="the consistent recipe's steps")
    ap.add_argument("--out", type=Path, default=Path("docs/results/distillation"))
    ap.add_argument("--lever", default="", help="a lever's name (appended to the row) and its distill options, e.g. "
                                                "'scratch:--distill-start scratch'")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    found = cells(args.work)
    scratch = args.work / "distillation"
    scratch.mkdir(exist_ok=True)
    for alpha in args.alphas:
        for seed in args.seeds:
            if (alpha, seed) not in found:
                print(f"alpha {alpha} seed {seed}: no fitted clients in {args.work}", file=sys.stderr)
                continue
            posts, part = found[(alpha, seed)]
            teacher = scratch / f"pool_{alpha}_{seed}.h5"
            if not teacher.exists():
                run("fuse", *posts, "--method", "ensemble", "--set", "pooling=label-shift", "--out", teacher)
            small = part / "server_unlabeled_500.h5"
            if not small.exists():
                full = posterior_fusion.read_data(part / "server_unlabeled.h5")
                write_silo(small, SiloData(full.x[:500], None, full.dataset, full.num_classes, transform=full.transform))
            lever, _, extra = args.lever.partition(":")
            for row in args.rows:
                tag = f"{row}+{lever}" if lever and row in LEVERED else row
                result = args.out / f"{alpha}_{seed}_{tag}.json"
                if result.exists():
                    continue
                t0 = time.time()
                if row == "pool":
                    target = teacher
                elif row == "ensemble":
                    target = scratch / f"ensemble_{alpha}_{seed}.h5"
                    run("fuse", *posts, "--method", "ensemble", "--out", target)
                elif row == "swa":
                    target = scratch / f"swa_{alpha}_{seed}.h5"
                    run("fuse", *posts, "--method", "ensemble", "--set", "pooling=label-shift", "--distill",
                        "--distill-recipe", "swa", "--unlabeled", part / "server_unlabeled.h5", "--out", target)
                else:
                    target = scratch / f"{tag}_{alpha}_{seed}.h5"
                    data = {"consistent-5000": ["--unlabeled", part / "server_unlabeled.h5"],
                            "consistent-500": ["--unlabeled", small], "data-free": ["--distill-input-shape", "1,28,28"],
                            "plain-teacher": ["--unlabeled", part / "server_unlabeled.h5"]}
                    pooling = [] if row == "plain-teacher" else ["--set", "pooling=label-shift"]
                    run("fuse", *posts, "--method", "ensemble", *pooling, "--distill",
                        "--distill-steps", args.steps, *data[row], *extra.split(), "--out", target)
                seconds = time.time() - t0
                metrics = json.loads(run("evaluate", target, "--data", part / "test.h5", "--json"))
                metrics = metrics[0] if isinstance(metrics, list) else metrics
                g = posterior_fusion.load(target)
                record = dict(g.metadata.get("distill") or {})
                out = {"alpha": alpha, "seed": seed, "row": tag, "accuracy": metrics["accuracy"], "nll": metrics["nll"],
                       "ece": metrics["ece"], "members": len(g.members), "server_seconds": round(seconds, 1),
                       "agreement": record.get("agreement"), "flip": record.get("flip"),
                       "synthesis": record.get("synthesis")}
                result.write_text(json.dumps(out, indent=2))
                print(f"alpha {alpha} seed {seed} {tag}: {100 * out['accuracy']:.2f}% in {seconds:.0f}s", flush=True)


if __name__ == "__main__":
    main()
