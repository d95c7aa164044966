"""The last-layer full GGN (``fastcapture.last_layer_ggn``) ÷ one training epoch, against another
version of ``fastcapture.py`` (e.g. an older commit's), alternating in one process; process CPU time,
median of ``--rounds``; also the largest relative difference of the two results.

    git show c6732eb:posterior_fusion/local/fastcapture.py > /tmp/fastcapture_old.py
    PFUSE_PROGRESS=0 .venv/bin/python benchmarks/last_layer_bench.py --against /tmp/fastcapture_old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR, SYSTEM_FMNIST_DIR, load_fmnist
from posterior_fusion.local import fastcapture
from posterior_fusion.local.config import TrainConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
from posterior_fusion.runtime import keep_freed_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="path of the other fastcapture.py")
    ap.add_argument("--n", type=int, default=10000, help="training images (default 10000)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("other_fastcapture", args.against)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    try:
        x, y = load_fmnist("train", SYSTEM_FMNIST_DIR)
    except Exception:  # noqa: BLE001 - fall back to the embedded subset
        x, y = load_fmnist("train", EMBEDDED_FMNIST_DIR)
    x, y = torch.as_tensor(x[: args.n]).float().unsqueeze(1), torch.as_tensor(y[: args.n]).long()
    torch.manual_seed(0)
    model, copy = ModelSpec("lenet", {}).build(), ModelSpec("lenet", {}).build()
    cfg = TrainConfig(epochs=1, batch_size=64, weight_decay=0.0)
    train_map(model, x, y, cfg, seed=0, desc="epoch")
    times: dict[str, list[float]] = {"epoch": [], "other": [], "this": []}
    for r in range(args.rounds):
        copy.load_state_dict(model.state_dict())
        t0 = time.process_time()
        train_map(copy, x, y, cfg, seed=r, desc="epoch")
        times["epoch"].append(time.process_time() - t0)
        for name, module in (("other", other), ("this", fastcapture)):
            t0 = time.process_time()
            module.last_layer_ggn(model, x)
            times[name].append(time.process_time() - t0)
    a, b = other.last_layer_ggn(model, x), fastcapture.last_layer_ggn(model, x)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"n = {args.n}, threads = {args.threads}, rounds = {args.rounds} (process CPU s, median)")
    print(f"epoch {med['epoch']:.3f} s; other {med['other']:.3f} s = {med['other'] / med['epoch']:.2f} epochs; "
          f"this {med['this']:.3f} s = {med['this'] / med['epoch']:.2f} epochs; {med['other'] / med['this']:.2f}x; "
          f"max relative difference {float((a - b).abs().max() / a.abs().max()):.1e}")


if __name__ == "__main__":
    main()
