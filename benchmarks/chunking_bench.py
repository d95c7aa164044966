"""One fedbens objective step (forward + backward, K = 5 modes) against N stacked LeNet K-FAC
components, whole vs chunked (working set ≤ 64 MiB), side by side in one run.

    .venv/bin/python benchmarks/chunking_bench.py --artifacts 'runs/x/clients/<key>/post_*.h5' --sizes 25,100,200
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import statistics
import time

import torch

import posterior_fusion
from posterior_fusion.fusion.gaussian_stack import StackedGaussians


def step_ms(stack, W, chunk, reps=3):
    times = []
    for _ in range(reps):
        Wr = W.clone().requires_grad_(True)
        t0 = time.perf_counter()
        total = torch.zeros(W.shape[0], stack.num)
        for b in stack.blocks:
            w = Wr[:, b.offset : b.offset + b.size]
            total = total + (b.quadratic_forms(w, chunk_bytes=chunk) if hasattr(b, "rank") else b.quadratic_forms(w))
        total.sum().backward()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--sizes", default="25,100,200")
    args = ap.parse_args()
    comps = [c for p in sorted(glob.glob(args.artifacts)) for c in posterior_fusion.load(p).components]
    for n in map(int, args.sizes.split(",")):
        stack = StackedGaussians([comps[i % len(comps)] for i in range(n)], 10.0, 10.0, torch.float32)
        W = torch.stack([comps[i].map.float() for i in range(5)])
        row = {"N": n, "threads": torch.get_num_threads()}
        for label, chunk in (("whole", 1 << 40), ("chunked", 64 * 2**20)):
            row[f"{label}_ms"] = round(step_ms(stack, W, chunk), 1)
        row["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
