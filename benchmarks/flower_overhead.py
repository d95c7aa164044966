"""Wall time of the same one-shot round through files vs through a Flower simulation.

    .venv/bin/python benchmarks/flower_overhead.py --out runs/flower-overhead [--epochs 2] [--components 2]

Same silos (embedded Fashion-MNIST subset, 5 clients, alpha=0.1), same settings, same fusion
(fedbens, server validation). File path: fit_to_artifact per silo, one after another, then
fuse. Flower path: run_simulation with 5 SuperNodes on 2 single-CPU Ray actors, whose
ServerApp validates the replies and fuses. Also checks that both global artifacts agree.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import posterior_fusion  # noqa: E402
from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR  # noqa: E402
from posterior_fusion.data.prepare import partition_to_files  # noqa: E402
from posterior_fusion.flower import FederatedSettings, fit_to_artifact, make_client_app, make_server_app  # noqa: E402
from posterior_fusion.fusion import FusionOptions, fuse  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--components", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.out)
    summary = partition_to_files(out / "data", clients=5, alpha=0.1, partition_seed=0, data_dir=EMBEDDED_FMNIST_DIR)
    settings = FederatedSettings(components=args.components, epochs=args.epochs)
    opts = FusionOptions(progress=False)

    t0 = time.perf_counter()
    files = []
    for i in range(5):
        files.append(out / "files" / f"client_{i}.h5")
        files[-1].parent.mkdir(parents=True, exist_ok=True)
        fit_to_artifact(settings, summary["clients"][i]["path"], files[-1])
    t_fit = time.perf_counter() - t0
    _, ref, _ = fuse(files, "fedbens", opts, summary["server_val"])
    t_file = time.perf_counter() - t0

    from flwr.simulation import run_simulation

    t0 = time.perf_counter()
    run_simulation(make_server_app(settings, out / "flower", "fedbens", opts, summary["server_val"], min_nodes=5),
                   make_client_app(out / "data"), num_supernodes=5,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    t_flower = time.perf_counter() - t0
    g = posterior_fusion.load(out / "flower" / "global.h5")
    diff = max((a - b).abs().max().item() for a, b in zip(ref.members, g.members))
    row = {"file_path_s": round(t_file, 1), "file_fit_s": round(t_fit, 1), "flower_path_s": round(t_flower, 1),
           "overhead_s": round(t_flower - t_file, 1), "ratio": round(t_flower / t_file, 2),
           "max_abs_member_diff": diff, "torch_threads_main": torch.get_num_threads()}
    print(json.dumps(row))
    (out / "results.json").write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
