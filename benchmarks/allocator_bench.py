"""glibc's default allocator against :func:`posterior_fusion.runtime.keep_freed_memory`, side by side.

    .venv/bin/python benchmarks/allocator_bench.py --threads 1 --rounds 3 \
        --artifacts 'runs/table1_seeds12/clients/80b78048283034d5/post_*.h5'

Each round runs one fresh process per setting (``default`` = glibc as it comes, ``keep`` =
``keep_freed_memory()`` first), alternating, and each process times, after a warm-up: one LeNet
training epoch (batch 64) on 10,000 Fashion-MNIST images, the fast exact K-FAC capture of the same
images, and (with ``--artifacts``) a fedbens fusion of 50 Adam steps. Reported: the median over
rounds of CPU seconds (user + system: page faults are system time) and wall seconds, minor page
faults, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def one(setting: str, threads: int, artifacts: str | None) -> dict:
    from posterior_fusion.runtime import keep_freed_memory

    if setting == "keep" and not keep_freed_memory():
        raise SystemExit("keep_freed_memory() did not take effect here (not glibc?)")
    import torch
    from capture_bench import fmnist_train

    from posterior_fusion.local.capture import capture
    from posterior_fusion.local.fit_config import TrainConfig
    from posterior_fusion.local.train import train_map
    from posterior_fusion.models import ModelSpec

    torch.set_num_threads(threads)
    x, y = fmnist_train(10000)
    torch.manual_seed(0)
    model = ModelSpec("lenet", {}).build()
    cfg = TrainConfig(epochs=1, batch_size=64, weight_decay=0.0)
    train_map(model, x, y, cfg, seed=0, desc="warm-up")

    def timed(fn) -> dict:
        f0, c0, w0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
        fn()
        return {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0,
                "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}

    out = {"epoch": timed(lambda: train_map(model, x, y, cfg, seed=1, desc="epoch"))}
    model.eval()
    out["capture"] = timed(lambda: capture("kron", model, x, y, 256, "exact", "fast"))
    if artifacts:
        import posterior_fusion
        from posterior_fusion.fusion import FusionOptions, fuse_clients

        clients = [posterior_fusion.load(p) for p in sorted(glob.glob(artifacts))]
        fuse_clients(clients, "fedbens", FusionOptions(progress=False), {"steps": 3, "laplace": False, "solver": "adam"})
        out["fuse"] = timed(lambda: fuse_clients(clients, "fedbens", FusionOptions(progress=False),
                                                 {"steps": 50, "laplace": False, "solver": "adam"}))
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating process pairs (default 3)")
    ap.add_argument("--artifacts", default=None, help="glob of client artifacts to time a fedbens fusion on (optional)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.threads, args.artifacts)))
        return
    runs: dict[str, list[dict]] = {"default": [], "keep": []}
    for _ in range(args.rounds):
        for setting in runs:
            cmd = [sys.executable, __file__, "--one", setting, "--threads", str(args.threads)]
            cmd += ["--artifacts", args.artifacts] if args.artifacts else []
            env = {k: v for k, v in os.environ.items() if k != "PFUSE_MALLOC"} | {"PFUSE_PROGRESS": "0"}
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            runs[setting].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"threads = {args.threads}, rounds = {args.rounds} (median over rounds)")
    print(f"{'phase':8s} {'setting':8s} {'cpu s':>7s} {'wall s':>7s} {'faults':>8s}")
    for phase in [p for p in runs["default"][0] if p != "peak_rss_mib"]:
        for setting, rs in runs.items():
            med = {k: statistics.median(r[phase][k] for r in rs) for k in ("cpu_s", "wall_s", "faults")}
            print(f"{phase:8s} {setting:8s} {med['cpu_s']:7.2f} {med['wall_s']:7.2f} {med['faults']:8.0f}")
        d, k = (statistics.median(r[phase]["cpu_s"] for r in runs[s]) for s in ("default", "keep"))
        print(f"{phase:8s} speed-up (cpu) {d / k:.2f}x")
    for setting, rs in runs.items():
        print(f"peak RSS {setting}: {statistics.median(r['peak_rss_mib'] for r in rs):.0f} MiB")


if __name__ == "__main__":
    main()
