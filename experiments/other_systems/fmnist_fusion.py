"""Every fusion method from the same client artifacts on the full Fashion-MNIST.

    .venv/bin/python experiments/other_systems/fmnist_fusion.py --alpha 0.1 --components 5 --epochs 20 \
        --structure kron --out runs/fmnist-a0.1-kron [--seed 0]

Partitions (5 clients, FedBEns Dirichlet), fits every client once (cached: re-runs reuse
existing artifacts), fuses with each method with server validation, evaluates on the
10k test set and writes ``results.json`` and ``results.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from posterior_fusion.artifact import write_global_artifact
from posterior_fusion.data.prepare import partition_to_files
from posterior_fusion.data.silo import read_silo
from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion import FusionOptions, applicable_settings, fuse
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.fit import Start, fit_local
from posterior_fusion.local.fit_config import FitConfig, TrainConfig
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.models import ModelSpec

METHODS = ["fedbens", "fedfisher", "regmean", "fisher-merge", "fedavg", "product", "fedbe", "swag", "ensemble"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--components", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--structure", default="kron")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    t_start = time.perf_counter()
    summary = partition_to_files(out / "data", clients=args.clients, alpha=args.alpha, partition_seed=args.seed)
    print("partition:", [c["n"] for c in summary["clients"]], "from", summary["source"], flush=True)
    spec = ModelSpec("lenet", {})
    layout = ParameterLayout.from_model(spec.build())
    cfg = FitConfig(structure=args.structure, train_seed=args.seed,
                    train=TrainConfig(epochs=args.epochs, swag=True, swag_rank=20))
    paths, fit_times = [], []
    for i, c in enumerate(summary["clients"]):
        path = out / f"post_{i}.h5"
        paths.append(path)
        if path.exists():
            continue
        t0 = time.perf_counter()
        fit_local(spec, c["path"], Start(args.seed, args.components), cfg, path,
                  log=lambda m, i=i: print(f"client {i}:", m, flush=True))
        fit_times.append(time.perf_counter() - t0)
    test = read_silo(summary["test"])
    rows = []
    for method in args.methods.split(","):
        try:
            _, res, meta = fuse(paths, method, FusionOptions(sampling_seed=args.seed, progress=False),
                                applicable_settings(method, {"steps": args.steps}),
                                val_path=summary["server_val"])
        except MethodNotApplicableError as exc:
            print(f"{method}: skipped: {exc}", flush=True)
            continue
        write_global_artifact(out / f"global_{method}.h5", spec, layout, meta, res.members)
        m = evaluate_members(spec, res.members, test)
        row = {"method": method, "members": len(res.members), "accuracy": m["accuracy"], "nll": m["nll"],
               "ece": m["ece"], "brier": m["brier"], "member_acc_min": m["member_accuracy_min"],
               "member_acc_max": m["member_accuracy_max"], "fuse_seconds": meta["fuse_seconds"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"args": vars(args), "torch": torch.__version__, "partition": [c["n"] for c in summary["clients"]],
              "fit_seconds_per_client": fit_times, "total_seconds": time.perf_counter() - t_start, "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    lines = ["| method | members | accuracy | NLL | ECE | Brier | fuse s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['members']} | {100 * r['accuracy']:.2f} | {r['nll']:.3f} | {r['ece']:.3f} "
                     f"| {r['brier']:.3f} | {r['fuse_seconds']:.1f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
