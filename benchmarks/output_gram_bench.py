"""Fast exact/MC K-FAC capture with the output-gradient Gram taken per sample (the default) against
the column chunks of a transposed copy (the path before), alternating in one process; process CPU
time, median of ``--rounds``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/output_gram_bench.py --n 5000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR, SYSTEM_FMNIST_DIR, load_fmnist
from posterior_fusion.local import fastcapture
from posterior_fusion.local.config import TrainConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
from posterior_fusion.runtime import keep_freed_memory


def columns_gram(module, g):
    return fastcapture._gram(fastcapture._grad_columns(module, g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000, help="training images (default 5000)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    try:
        x, y = load_fmnist("train", SYSTEM_FMNIST_DIR)
    except Exception:  # noqa: BLE001 - fall back to the embedded subset
        x, y = load_fmnist("train", EMBEDDED_FMNIST_DIR)
    x, y = torch.as_tensor(x[: args.n]).float().unsqueeze(1), torch.as_tensor(y[: args.n]).long()
    torch.manual_seed(0)
    model = ModelSpec("lenet", {}).build()
    train_map(model, x, y, TrainConfig(epochs=1, batch_size=64, weight_decay=0.0), seed=0, desc="epoch")
    per_sample = fastcapture._output_gram
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for ggn in ("exact", "mc"):
            for name, fn in (("columns", columns_gram), ("per-sample", per_sample)):
                fastcapture._output_gram = fn
                t0 = time.process_time()
                fastcapture.fast_kron(model, x, y, ggn=ggn, generator=torch.Generator().manual_seed(0))
                times.setdefault((ggn, name), []).append(time.process_time() - t0)
    fastcapture._output_gram = per_sample
    print(f"n = {args.n}, threads = {args.threads}, rounds = {args.rounds} (process CPU s, median)")
    for ggn in ("exact", "mc"):
        a, b = statistics.median(times[(ggn, "columns")]), statistics.median(times[(ggn, "per-sample")])
        print(f"{ggn:>5}: columns {a:.2f} s, per-sample {b:.2f} s, {a / b:.2f}x")


if __name__ == "__main__":
    main()
