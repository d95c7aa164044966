"""Curvature capture ÷ one training epoch, laplace-torch vs the fast path, side by side in one run.

    .venv/bin/python benchmarks/capture_bench.py --n 10000 --threads 1 [--model lenet] [--repeats 3]

For each structure (kron, diag, diag+full) and GGN type (exact, mc): the median of ``--repeats``
captures with each method, divided by the median time of one SGD epoch (batch 64, as fit-local)
on the same data; also the largest relative difference of the two captures (Frobenius norm per
tensor). Real Fashion-MNIST (the installed full set, else the embedded subset).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR, SYSTEM_FMNIST_DIR, load_fmnist
from posterior_fusion.local.capture import capture
from posterior_fusion.local.config import TrainConfig
from posterior_fusion.local.fastcapture import last_layer_ggn
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--structures", default="kron,diag,diag+full")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        x, y = load_fmnist("train", SYSTEM_FMNIST_DIR)
    except Exception:  # noqa: BLE001 - fall back to the embedded subset
        x, y = load_fmnist("train", EMBEDDED_FMNIST_DIR)
    x = torch.as_tensor(x[: args.n]).float().unsqueeze(1)
    y = torch.as_tensor(y[: args.n]).long()
    spec = ModelSpec(args.model, {})
    torch.manual_seed(0)
    model = spec.build()
    epochs = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        train_map(model, x, y, TrainConfig(epochs=1, batch_size=64, weight_decay=0.0), seed=r, desc="epoch")
        epochs.append(time.perf_counter() - t0)
    epoch = statistics.median(epochs)
    model.eval()
    print(f"model {args.model}, n = {len(x)}, threads = {args.threads}, one epoch = {epoch:.2f}s (median of {args.repeats})")
    ll = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        last_layer_ggn(model, x, 256)
        ll.append(time.perf_counter() - t0)
    print(f"last-layer full GGN alone (fast, closed form): {statistics.median(ll):.2f}s = "
          f"{statistics.median(ll) / epoch:.2f} epochs", flush=True)
    rows = []
    for structure in args.structures.split(","):
        for ggn in ("exact", "mc"):
            times, results = {}, {}
            for method in ("laplace", "fast"):
                ts = []
                for r in range(args.repeats):
                    t0 = time.perf_counter()
                    curv, how = capture(structure, model, x, y, 256, ggn, method, torch.Generator().manual_seed(r))
                    ts.append(time.perf_counter() - t0)
                    assert how == method
                times[method], results[method] = statistics.median(ts), curv
            diff = max(((a.to_tensors()[k] - b.to_tensors()[k]).norm() / a.to_tensors()[k].norm()).item()
                       for a, b in zip(results["laplace"].blocks, results["fast"].blocks) for k in a.to_tensors())
            row = {"structure": structure, "ggn": ggn, "laplace_s": round(times["laplace"], 2),
                   "fast_s": round(times["fast"], 2), "laplace_epochs": round(times["laplace"] / epoch, 2),
                   "fast_epochs": round(times["fast"] / epoch, 2),
                   "speedup": round(times["laplace"] / times["fast"], 2), "max_rel_diff": float(f"{diff:.2e}")}
            rows.append(row)
            print(f"{structure:10s} {ggn:5s} laplace {row['laplace_s']:7.2f}s = {row['laplace_epochs']:5.2f} epochs | "
                  f"fast {row['fast_s']:7.2f}s = {row['fast_epochs']:5.2f} epochs | x{row['speedup']:.2f} | "
                  f"diff {diff:.1e}" + ("  (MC: different label draws)" if ggn == "mc" else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "n": len(x), "threads": args.threads, "epoch_s": epoch, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
