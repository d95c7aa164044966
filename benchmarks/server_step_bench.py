"""One fedbens objective step (quadratic forms of K = M modes against N = C·M stacked LeNet
K-FAC components, forward + backward) three ways, side by side: ``rotated`` (eigenbases and
autograd: the unbatched step), ``direct`` (raw factors, autograd through the blocks) and
``objective`` (what ``pfuse fuse`` runs: ``GlobalLogPosterior.value_and_gradient``, the direct
form with each block's vector-Jacobian product, no autograd graph, clients in bounded chunks).
Each configuration runs in its own process so its peak memory is its own.

    .venv/bin/python benchmarks/server_step_bench.py \
        --artifacts 'runs/table1_seeds12/clients/<key>/post_*.h5' --threads 1

Real client artifacts (M = 5 components each) are repeated to reach C clients and M components.
Prints ms per step and the step's extra peak RSS in MiB; the speed-up is rotated ÷ objective.
Each process times at least 5 steps and at least one second of them after a warm-up and reports
their median; the three forms' processes
alternate ``--rounds`` times (default 3) and the table shows the median over rounds, so a change
of background load hits every form alike.
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def median_ms(step) -> float:
    """Median milliseconds of ``step()`` over at least 5 calls and 1 s of them, after one warm-up call."""
    step()
    times: list[float] = []
    while len(times) < 5 or sum(times) < 1000:
        t0 = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def repeat_components(clients, C: int, M: int):
    """``(per_client, comps)``: C clients of M components each, the real clients' components repeated in turn."""
    import dataclasses

    pool = [c for cl in clients for c in cl.components]
    comps = [pool[i % len(pool)] for i in range(C * M)]
    per_client = [dataclasses.replace(clients[c % len(clients)], components=tuple(comps[c * M : (c + 1) * M]))
                  for c in range(C)]
    return per_client, comps


def rotated_step(stack, W: torch.Tensor, form: str = "rotated"):
    """One step through autograd over every block of ``stack`` (the unbatched step with
    ``form="rotated"``): log-sum-exp over all components, backward to ``W`` ``(K, d)``."""

    def step() -> None:
        Wr = W.clone().requires_grad_(True)
        total = torch.zeros(W.shape[0], stack.num, device=W.device)
        for b in stack.blocks:
            w = Wr[:, b.offset : b.offset + b.size]
            total = total + (b.quadratic_forms(w, form=form) if hasattr(b, "rank") else b.quadratic_forms(w))
        total.logsumexp(1).sum().backward()

    return step


def one(artifacts: list[str], C: int, M: int, form: str, threads: int, keep: bool) -> dict:
    import posterior_fusion
    from posterior_fusion.runtime import keep_freed_memory

    if keep:
        keep_freed_memory()
    from posterior_fusion.fusion.gaussian_stack import StackedGaussians
    from posterior_fusion.fusion.methods.fedbens import GlobalLogPosterior

    torch.set_num_threads(threads)
    clients = [posterior_fusion.load(p) for p in artifacts]
    per_client, comps = repeat_components(clients, C, M)
    W = torch.stack([comps[k].map for k in range(M)]).float() + 0.01
    if form == "objective":
        objective = GlobalLogPosterior(per_client, [0.1] * C, [10.0] * C, 10.0, torch.float32)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        def step() -> None:
            objective.value_and_gradient(W)
    else:
        stack = StackedGaussians(comps, 1 / 0.1, 10.0, torch.float32)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step = rotated_step(stack, W, form)

    ms = median_ms(step)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"C": C, "M": M, "form": form, "ms": round(ms, 1),
            "extra_peak_mib": round((peak - base) / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="both forms call posterior_fusion.runtime.keep_freed_memory() first, as pfuse does")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of the three forms per configuration (default 3)")
    ap.add_argument("--grid", default="5x1,5x2,5x5,5x10,10x5,20x5,40x5", help="CxM configurations")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    files = sorted(glob.glob(args.artifacts))
    if args.one:
        C, M, form = args.one.split(",")
        print(json.dumps(one(files, int(C), int(M), form, args.threads, args.keep_freed_memory)))
        return
    print(f"threads = {args.threads}, artifacts = {len(files)} files, rounds = {args.rounds}, "
          f"keep freed memory = {args.keep_freed_memory}")
    print(f"{'C':>3} {'M':>3} {'rotated ms':>11} {'direct ms':>10} {'objective ms':>12} {'speed-up':>8} "
          f"{'ms/pair rot':>11} {'ms/pair obj':>11} {'peak rot MiB':>12} {'peak dir MiB':>12} {'peak obj MiB':>12}")
    rows = []
    for cm in args.grid.split(","):
        C, M = (int(v) for v in cm.split("x"))
        runs: dict[str, list[dict]] = {"rotated": [], "direct": [], "objective": []}
        for _ in range(args.rounds):
            for form in runs:
                out = subprocess.run([sys.executable, __file__, "--artifacts", args.artifacts, "--threads",
                                      str(args.threads), "--one", f"{C},{M},{form}"]
                                     + (["--keep-freed-memory"] if args.keep_freed_memory else []), capture_output=True, text=True,
                                     check=True)
                runs[form].append(json.loads(out.stdout.strip().splitlines()[-1]))
        pairs = M * C * M
        r, d, o = ({"ms": statistics.median(x["ms"] for x in runs[f]),
                    "extra_peak_mib": max(x["extra_peak_mib"] for x in runs[f])} for f in runs)
        rows.append({"C": C, "M": M, "rotated": r, "direct": d, "objective": o})
        print(f"{C:>3} {M:>3} {r['ms']:>11.1f} {d['ms']:>10.1f} {o['ms']:>12.1f} {r['ms'] / o['ms']:>8.2f} "
              f"{r['ms'] / pairs:>11.3f} {o['ms'] / pairs:>11.3f} {r['extra_peak_mib']:>12.1f} "
              f"{d['extra_peak_mib']:>12.1f} {o['extra_peak_mib']:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
