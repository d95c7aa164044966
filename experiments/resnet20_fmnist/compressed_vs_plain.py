"""Compressed against plain artifacts of the same fits: every client artifact of a grid
cell rewritten with ``--compress`` budgets (the same components, factors stored as top eigenpairs
plus an isotropic rest), then ``pfuse fuse`` with each method and ``pfuse evaluate`` on the cell's
test set, plain and compressed side by side.

    nice -n 19 .venv/bin/python experiments/resnet20_fmnist/compressed_vs_plain.py --clients runs/resnet20_fmnist/clients/<key> \
        --test runs/resnet20_fmnist/partitions/<key>/test.h5 --val runs/resnet20_fmnist/partitions/<key>/server_val.h5 --budgets 0.05,0.1 --methods fedbens,fedfisher,regmean \
        --json docs/results/real_size/compressed_vs_plain_a0.1.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.choices import VECTOR_DTYPES
from posterior_fusion.curvature.compressed import Compression
from posterior_fusion.experiment.measure import save_rows

CLI = [sys.executable, "-c", "from posterior_fusion.cli.main import main; main()"]


def run(*args) -> str:
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed: {proc.stderr.strip().splitlines()[-1]}")
    return proc.stdout


def errors(path: Path) -> list[float]:
    """Every factor's recorded relative error in a compressed artifact."""
    out = []
    with h5py.File(path) as f:
        for comp in f["components"].values():
            for b in json.loads(comp["curvature"].attrs["blocks"]):
                out += b.get("error", [])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", required=True, help="folder of post_<i>.h5 client artifacts")
    ap.add_argument("--test", required=True)
    ap.add_argument("--val", default=None, help="server validation file passed to fuse (best-iterate selection)")
    ap.add_argument("--budgets", default="0.05,0.1")
    ap.add_argument("--methods", default="fedbens,fedfisher,regmean,fedavg")
    ap.add_argument("--metric", default="frobenius", choices=["frobenius", "precision"],
                    help="the error the budgets bound (fit-local --compress-metric; default frobenius)")
    ap.add_argument("--vectors", default="float32", choices=VECTOR_DTYPES,
                    help="storage type of the kept eigenvectors (fit-local --compress-vectors; default float32)")
    ap.add_argument("--skip-plain", action="store_true", help="leave out the plain artifacts' rows (run before)")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                    help="a fuse method setting passed to every fuse (repeatable; e.g. solver=em)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    settings = [a for kv in args.settings for a in ("--set", kv)]
    plain = sorted(Path(args.clients).glob("post_*.h5"))
    work = Path(tempfile.mkdtemp(prefix="compress_"))
    sets = {} if args.skip_plain else {0.0: plain}
    sizes = {0.0: sum(p.stat().st_size for p in plain)}
    errs: dict[float, list[float]] = {}
    for budget in map(float, args.budgets.split(",")):
        sets[budget] = []
        for p in plain:
            art = posterior_fusion.load(p)
            out = work / f"{p.stem}_{budget}.h5"
            write_client_artifact(out, art.model_spec, art.layout, dict(art.metadata), list(art.components),
                                  Compression(budget, args.metric, args.vectors))
            sets[budget].append(out)
        sizes[budget] = sum(p.stat().st_size for p in sets[budget])
        errs[budget] = [e for p in sets[budget] for e in errors(p)]
    rows = []
    for method in args.methods.split(","):
        for budget, paths in sets.items():
            t0 = time.time()
            g = work / f"g_{method}_{budget}.h5"
            run("fuse", *paths, "--method", method, *(["--val", args.val] if args.val else []), *settings,
                "--out", g)
            metrics = json.loads(run("evaluate", g, "--data", args.test, "--json"))
            m = metrics[0] if isinstance(metrics, list) else metrics
            row = {"method": method, "settings": args.settings, "compress": budget, "metric": args.metric, "vectors": args.vectors, "accuracy": m.get("accuracy"), "nll": m.get("nll"),
                   "ece": m.get("ece"), "fuse_evaluate_s": round(time.time() - t0, 1),
                   "mb_per_component": round(sizes[budget] / 1e6 / sum(posterior_fusion.load(p).num_components
                                                                       for p in plain), 2)}
            if budget:
                row["max_factor_error"] = round(max(errs[budget]), 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    save_rows(args.json, rows)


if __name__ == "__main__":
    main()
