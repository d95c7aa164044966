"""Curvature capture ÷ one training epoch, laplace-torch vs the fast path, side by side in one run.

    .venv/bin/python benchmarks/capture_bench.py --n 10000 --threads 1 [--model lenet] [--repeats 3] [--keep-freed-memory]

For each structure (kron, diag, diag+full) and GGN type (exact, mc): each capture is divided by
the time of one SGD epoch (batch 64, as fit-local, on a copy of the model) timed just before it,
so a change of background load hits both; the median of ``--repeats`` such ratios per method; also the largest relative difference of the two captures (Frobenius norm per
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
from posterior_fusion.local.capture.fast import last_layer_ggn
from posterior_fusion.local.fit_config import TrainConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
from posterior_fusion.runtime import keep_freed_memory


def fmnist_train(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` Fashion-MNIST training images ``(n, 1, 28, 28)`` and labels ``(n,)``: the installed
    full set, else the embedded subset (shared by the capture and allocator benchmarks)."""
    try:
        x, y = load_fmnist("train", SYSTEM_FMNIST_DIR)
    except Exception:  # noqa: BLE001 - fall back to the embedded subset
        x, y = load_fmnist("train", EMBEDDED_FMNIST_DIR)
    return torch.as_tensor(x[:n]).float().unsqueeze(1), torch.as_tensor(y[:n]).long()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--structures", default="kron,diag,diag+full")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="call posterior_fusion.runtime.keep_freed_memory() first, as pfuse does (default: off)")
    args = ap.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
    torch.set_num_threads(args.threads)
    x, y = fmnist_train(args.n)
    spec = ModelSpec(args.model, {})
    torch.manual_seed(0)
    model = spec.build()
    model_train = spec.build()

    epochs: list[float] = []

    def epoch_time(seed: int) -> float:
        """One SGD epoch (batch 64, as fit-local) on a copy of the model, so the captured one stays fixed."""
        model_train.load_state_dict(model.state_dict())
        t0 = time.perf_counter()
        train_map(model_train, x, y, TrainConfig(epochs=1, batch_size=64, weight_decay=0.0), seed=seed, desc="epoch")
        epochs.append(time.perf_counter() - t0)
        return epochs[-1]

    # warm-up (first-call costs) that also trains the captured model for one epoch
    train_map(model, x, y, TrainConfig(epochs=1, batch_size=64, weight_decay=0.0), seed=0, desc="epoch")
    model.eval()
    print(f"model {args.model}, n = {len(x)}, threads = {args.threads}; every capture is divided by an epoch "
          f"timed just before it (median over {args.repeats} pairs)")
    ll = []
    for r in range(args.repeats):
        ep = epoch_time(r)
        t0 = time.perf_counter()
        last_layer_ggn(model, x, 256)
        ll.append((time.perf_counter() - t0) / ep)
    print(f"last-layer full GGN alone (fast, closed form): {statistics.median(ll):.2f} epochs", flush=True)
    rows = []
    for structure in args.structures.split(","):
        for ggn in ("exact", "mc"):
            ratios: dict[str, list[float]] = {"laplace": [], "fast": []}
            results = {}
            for r in range(args.repeats):
                for method in ("laplace", "fast"):
                    ep = epoch_time(r)
                    t0 = time.perf_counter()
                    curv, how = capture(structure, model, x, y, 256, ggn, method, torch.Generator().manual_seed(r))
                    ratios[method].append((time.perf_counter() - t0) / ep)
                    if how != method:
                        raise SystemExit(f"capture ran {how!r}, not {method!r}")
                    results[method] = curv
            lap, fast = statistics.median(ratios["laplace"]), statistics.median(ratios["fast"])
            diff = max(((a.to_tensors()[k] - b.to_tensors()[k]).norm() / a.to_tensors()[k].norm()).item()
                       for a, b in zip(results["laplace"].blocks, results["fast"].blocks) for k in a.to_tensors())
            row = {"structure": structure, "ggn": ggn, "laplace_epochs": round(lap, 2), "fast_epochs": round(fast, 2),
                   "speedup": round(lap / fast, 2), "max_rel_diff": float(f"{diff:.2e}")}
            rows.append(row)
            print(f"{structure:10s} {ggn:5s} laplace {lap:5.2f} epochs | fast {fast:5.2f} epochs | x{lap / fast:.2f} | "
                  f"diff {diff:.1e}" + ("  (MC: different label draws)" if ggn == "mc" else ""), flush=True)
    print(f"one epoch: median {statistics.median(epochs):.2f}s, range {min(epochs):.2f}-{max(epochs):.2f}s "
          f"over {len(epochs)} epochs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "n": len(x), "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
