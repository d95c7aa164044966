"""Peak memory and time of one whole fedbens objective step (value + gradient of −log p(w | D) for
K = M modes) as the number of clients C grows: every client at once (``chunk_bytes = 0``, the
memory profile of autograd through the whole sum: every component's ``B V A`` is kept until the
backward pass) against the default client chunks (each chunk's gradient computed and its products
released before the next chunk). Each configuration runs in its own process so its peak is its own.

    .venv/bin/python benchmarks/objective_memory_bench.py \\
        --artifacts 'runs/table1_seeds12/clients/35536602f69eedad/post_*.h5' --threads 1

Real client artifacts (M = 5 components each) are repeated to reach C clients. Prints the resident
memory once the objective is built ("held": the stacked artifacts themselves), the step's extra
peak over it, and ms per step (median of ≥ 5 steps and ≥ 1 s after a warm-up; the two settings'
processes alternate ``--rounds`` times and the table shows medians over rounds).
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import statistics
import subprocess
import sys

import torch
from server_step_bench import median_ms


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def one(artifacts: list[str], C: int, chunk_bytes: int | None, threads: int) -> dict:
    import posterior_fusion
    from posterior_fusion.fusion.methods.fedbens import GlobalLogPosterior
    from posterior_fusion.runtime import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(threads)
    pool = [posterior_fusion.load(p) for p in artifacts]
    clients = [pool[i % len(pool)] for i in range(C)]
    M = clients[0].num_components
    objective = GlobalLogPosterior(clients, [0.1] * C, [10.0] * C, 10.0, chunk_bytes=chunk_bytes)
    W0 = torch.stack([comp.map.float() for comp in clients[0].components]) + 0.01  # (M, d)
    del pool, clients
    held = rss_mib()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def step() -> None:
        W = W0.clone().requires_grad_(True)
        objective(W).sum().backward()

    ms = median_ms(step)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"C": C, "M": M, "chunks": len(objective.chunks(M, 4)), "held_mib": round(held, 1),
            "extra_peak_mib": round(peak - max(base, held), 1), "ms": round(ms, 1)}


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True, help="glob of client artifacts (kron, M components each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of the two settings (default 3)")
    ap.add_argument("--clients", default="5,10,20,40", help="numbers of clients C (default 5,10,20,40)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    files = sorted(glob.glob(args.artifacts))
    if args.one:
        C, chunk = args.one.split(",")
        print(json.dumps(one(files, int(C), None if chunk == "default" else int(chunk), args.threads)))
        return
    print(f"threads = {args.threads}, artifacts = {len(files)} files, rounds = {args.rounds}")
    print(f"{'C':>3} {'held MiB':>9} {'peak all MiB':>12} {'peak chunks MiB':>15} {'chunks':>6} "
          f"{'ms all':>8} {'ms chunks':>9}")
    for C in [int(c) for c in args.clients.split(",")]:
        runs: dict[str, list[dict]] = {"0": [], "default": []}
        for _ in range(args.rounds):
            for setting in runs:
                out = subprocess.run([sys.executable, __file__, "--artifacts", args.artifacts, "--threads",
                                      str(args.threads), "--one", f"{C},{setting}"],
                                     capture_output=True, text=True, check=True)
                runs[setting].append(json.loads(out.stdout))
        every, chunked = runs["0"], runs["default"]
        print(f"{C:>3} {med(chunked, 'held_mib'):>9.0f} {med(every, 'extra_peak_mib'):>12.1f} "
              f"{med(chunked, 'extra_peak_mib'):>15.1f} {chunked[0]['chunks']:>6} "
              f"{med(every, 'ms'):>8.1f} {med(chunked, 'ms'):>9.1f}", flush=True)


if __name__ == "__main__":
    main()
