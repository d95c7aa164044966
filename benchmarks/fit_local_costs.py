"""Cost of fit-local per curvature structure on one full Fashion-MNIST silo.

    .venv/bin/python benchmarks/fit_local_costs.py --silo runs/fmnist-a0.1-kron/data/client_0.h5 \
        --epochs 20 --out runs/fit-costs

For each structure (kron, diag, diag+full) and GGN type (exact, mc): one component trained
for ``--epochs`` from the same init, then curvature capture; prints training time per epoch,
capture time, capture/epoch ratio, artifact bytes and bytes per parameter (curvature only
and whole file), all measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.data.silo import read_silo
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import capture
from posterior_fusion.local.fit_config import TrainConfig
from posterior_fusion.local.init import initial_weights
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--silo", required=True)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = read_silo(args.silo)
    x, y = data.tensors()
    spec = ModelSpec("lenet", {})
    layout = ParameterLayout.from_model(spec.build())
    model = spec.build()
    vector_to_parameters(initial_weights(spec, 1, 0)[0], model.parameters())
    t0 = time.perf_counter()
    train_map(model, x, y, TrainConfig(epochs=args.epochs, weight_decay=0.1 * 10 / len(data)), seed=0)
    epoch_s = (time.perf_counter() - t0) / args.epochs
    print(f"n={len(data)} d={layout.dim} training {epoch_s:.2f}s/epoch", flush=True)
    w = parameters_to_vector(model.parameters()).detach().clone()
    rows = []
    for structure in ("kron", "diag", "diag+full"):
        for ggn in ("exact", "mc"):
            torch.manual_seed(0)
            t0 = time.perf_counter()
            curv, _ = capture(structure, model, x, y, 256, ggn, method="laplace")
            cap_s = time.perf_counter() - t0
            path = out / f"{structure}-{ggn}.h5"
            meta = {"n_data": len(data), "class_counts": data.class_counts(), "temperature": 0.1,
                    "prior_precision": 10.0, "structure": structure}
            write_client_artifact(path, spec, layout, meta, [Component(0, w, curv, {}, 0.1, 10.0)])
            row = {"structure": structure, "ggn": ggn, "capture_s": round(cap_s, 2), "epoch_s": round(epoch_s, 2),
                   "capture_per_epoch": round(cap_s / epoch_s, 2), "curvature_bytes": curv.nbytes,
                   "curvature_x_params": round(curv.nbytes / 4 / layout.dim, 2), "file_bytes": os.path.getsize(path),
                   "file_x_params": round(os.path.getsize(path) / 4 / layout.dim, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps({"n": len(data), "epoch_s": epoch_s, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
