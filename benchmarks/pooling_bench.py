"""Evaluating K LeNet weight vectors on n inputs (``models.functional.batched_logits``, the path of
every method's members) with the strided-view max pooling against torch's ``max_pool2d``,
alternating in one process; process CPU time per round, and whether the logits are bit-for-bit equal.

    .venv/bin/python benchmarks/pooling_bench.py --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from posterior_fusion.models import ModelSpec, functional, maxpool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--members", type=int, default=5, help="weight vectors K (default 5)")
    ap.add_argument("--n", type=int, default=10000, help="inputs (default 10000, FMNIST's test set size)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = ModelSpec("lenet", {})
    d = sum(p.numel() for p in spec.build().parameters())
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(args.members, d, generator=gen) * 0.05
    x = torch.randn(args.n, 1, 28, 28, generator=gen)
    views_pooling = maxpool.fast_max_pooling
    times: dict[str, list[float]] = {"views": [], "torch": []}
    out = {}
    try:
        for _ in range(args.rounds):
            for name, ctx in (("views", views_pooling), ("torch", lambda m: contextlib.nullcontext())):
                functional.fast_max_pooling = ctx
                t0 = time.process_time()
                out[name] = functional.batched_logits(spec, W, x)
                times[name].append(time.process_time() - t0)
    finally:
        functional.fast_max_pooling = views_pooling
    v, t = statistics.median(times["views"]), statistics.median(times["torch"])
    print(f"threads = {args.threads}, K = {args.members}, n = {args.n}, rounds = {args.rounds} (process CPU time, median)")
    print(f"torch max_pool2d {t:.2f} s, strided views {v:.2f} s, {t / v:.2f}x; "
          f"logits bit-for-bit equal: {torch.equal(out['views'], out['torch'])}")


if __name__ == "__main__":
    main()
