"""Models at real size: ResNet-20 at widths 16 / 32 / 64 on CIFAR-shaped data (3x32x32,
10 classes; random images and labels: the costs do not depend on the values), side by side in one run.

    nice -n 19 .venv/bin/python benchmarks/real_size_bench.py --threads 2 --widths 16,32,64 \
        --json docs/results/real_size/capture.json

``--device cuda`` runs the training and the captures on the GPU (times synchronised; ``fit-local --device cuda``
with its GPU peak, ``torch.cuda.max_memory_allocated``, beside the resident peak):

    python benchmarks/real_size_bench.py --device cuda --widths 16,32,64 --json capture_gpu.json

Per width: one SGD epoch (batch 64, as fit-local; after a warm-up, the faster of two) on ``--n`` images, then each capture on the same
model divided by that epoch (expand, reduce — exact GGN — and MC: reduce with one sampled label);
artifact MB per component plain and compressed (``--compress`` budgets: the same component written
each way) against the weights; and, in a fresh process per width, ``pfuse fit-local`` (M = 1,
1 epoch, batch 128, K-FAC-reduce, compressed) with its peak resident memory (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.curvature.compressed import Compression
from posterior_fusion.experiment.measure import run_measured, save_rows, sync
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import capture
from posterior_fusion.local.fit_config import TrainConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component, frozen_mapping

CAPTURES = (("expand", "exact"), ("reduce", "exact"), ("reduce", "mc"))


def fit_local_peak(data: Path, width: int, out: Path, device: str = "cpu") -> dict:
    args = ["fit-local", "--data", str(data), "--model", "resnet20", "--model-kwargs", json.dumps({"width": width}),
            "-M", "1", "--epochs", "1", "--batch-size", "128", "--kfac", "reduce", "--compress", "0.05",
            "--device", device, "--out", str(out)]
    r = run_measured(*args)
    return {k: r[k] for k in ("exit", "seconds", "peak_mib", "gpu_peak_mib", "error")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="16,32,64")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compress", default="0.05,0.1")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where training and capture run (default: cpu)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = args.device
    rows = []
    work = Path(tempfile.mkdtemp(prefix="realsize_"))
    g = np.random.default_rng(0)
    np.savez(work / "cifar_like.npz", x=g.integers(0, 256, (args.n, 3, 32, 32), dtype=np.uint8),
             y=g.integers(0, 10, args.n))
    subprocess.run([sys.executable, "-c", "from posterior_fusion.cli.main import main; main()", "import-data", str(work / "cifar_like.npz"), "--out",
                    str(work / "silo.h5")], check=True, capture_output=True)
    x = (torch.as_tensor(np.load(work / "cifar_like.npz")["x"]).float() / 255).to(dev)
    y = torch.as_tensor(np.load(work / "cifar_like.npz")["y"]).long().to(dev)
    for width in map(int, args.widths.split(",")):
        spec = ModelSpec("resnet20", {"width": width})
        torch.manual_seed(0)
        model = spec.build().to(dev)
        d = sum(p.numel() for p in model.parameters())
        train_map(model, x[:128], y[:128], TrainConfig(epochs=1, batch_size=64, weight_decay=0.0), 0)  # warm-up
        epochs = []
        for _ in range(2):  # the faster of two epochs: the machine is shared
            sync()
            t0 = time.perf_counter()
            train_map(model, x, y, TrainConfig(epochs=1, batch_size=64, weight_decay=0.0), 0, desc=f"width {width}")
            sync()
            epochs.append(time.perf_counter() - t0)
        epoch = min(epochs)
        row = {"width": width, "parameters": d, "n": args.n, "epoch_s": round(epoch, 2), "threads": args.threads, "device": dev}
        curv = None
        for kfac, ggn in CAPTURES:
            sync()
            t0 = time.perf_counter()
            c, how = capture("kron", model, x, y, 256, ggn, "fast", torch.Generator().manual_seed(0), kfac=kfac)
            sync()
            row[f"capture_{kfac}_{ggn}_how"] = how
            row[f"capture_{kfac}_{ggn}_s"] = round(time.perf_counter() - t0, 2)
            row[f"capture_{kfac}_{ggn}_per_epoch"] = round(row[f"capture_{kfac}_{ggn}_s"] / epoch, 2)
            if (kfac, ggn) == ("expand", "exact"):
                curv = c
        layout = ParameterLayout.from_model(model)
        w = torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
        comp = Component(0, w, curv, frozen_mapping({"seed": 0}), 0.1, 10.0)
        row["weights_mb"] = round(d * 4 / 1e6, 2)
        for budget in (0.0, *map(float, args.compress.split(","))):
            path = work / f"w{width}_{budget}.h5"
            write_client_artifact(path, spec, layout, {"n_data": args.n, "class_counts": [0] * 10, "temperature": 0.1,
                                                       "prior_precision": 10.0, "structure": "kron"}, [comp], Compression(budget))
            row[f"artifact_mb_{budget}"] = round(path.stat().st_size / 1e6, 2)
        row["fit_local"] = fit_local_peak(work / "silo.h5", width, work / f"fit_{width}.h5", dev)
        rows.append(row)
        print(json.dumps(row), flush=True)
    save_rows(args.json, rows)


if __name__ == "__main__":
    main()
