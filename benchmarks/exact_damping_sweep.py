"""FedFisher's and HBFL's exact solves (``--set solver=exact``) across the relative prior precision ε / mean
curvature (their setting ``prior_scale``; ``damping`` until session 24, the name this script's option and rows
keep) that pulls weakly determined directions to FedAvg: per value, the conjugate gradients'
iterations and residual, the largest weight, and validation and test accuracy of the fused model.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/exact_damping_sweep.py \\
        --clients runs/resnet20_fmnist/clients/<key> --val runs/resnet20_fmnist/partitions/<key>/server_val.h5 \\
        --test runs/resnet20_fmnist/partitions/<key>/test.h5 --dampings 1e-4,1e-3,1e-2,1e-1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from measured import save_rows

import posterior_fusion
from posterior_fusion.data.silo import read_data
from posterior_fusion.fusion import FusionInputs, FusionOptions
from posterior_fusion.fusion.optimise import accuracy_of
from posterior_fusion.fusion.registry import get_method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", required=True, help="folder of post_<i>.h5 client artifacts")
    ap.add_argument("--val", required=True, help="server validation file (accuracy reported, not used to fit)")
    ap.add_argument("--test", required=True)
    ap.add_argument("--dampings", default="1e-4,1e-3,1e-2,1e-1", help="comma-separated (default 1e-4,1e-3,1e-2,1e-1)")
    ap.add_argument("--variants", default="fedfisher,hbfl,hbfl:mean=map",
                    help="method[:key=value] per variant, comma-separated (default fedfisher,hbfl,hbfl:mean=map)")
    ap.add_argument("--component", type=int, default=0, help="which component index to fuse (default 0)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    clients = [posterior_fusion.load(p) for p in sorted(Path(args.clients).glob("post_*.h5"))]
    val, test = read_data(args.val), read_data(args.test)
    spec = clients[0].model_spec
    rows = []
    for damping in map(float, args.dampings.split(",")):
        for variant in args.variants.split(","):
            name, *extra = variant.split(":")
            method = get_method(name)
            values = {"solver": "exact", "prior_scale": damping, **dict(kv.split("=", 1) for kv in extra)}
            settings = method.settings.from_mapping(values, name)
            t0 = time.time()
            result = method.run(FusionInputs(clients, FusionOptions(progress=False, component=args.component)), settings)
            w = result.members[0][None]
            row = {"variant": variant, "damping": damping, "iterations": result.info["iterations"],
                   "residual": result.info["residual"], "max_abs_weight": float(w.abs().max()),
                   "val_accuracy": float(accuracy_of(spec, w, val)[0]),
                   "test_accuracy": float(accuracy_of(spec, w, test)[0]), "seconds": round(time.time() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    save_rows(args.json, rows)


if __name__ == "__main__":
    main()
