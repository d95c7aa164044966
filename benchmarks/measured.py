"""One ``pfuse`` command in a fresh process with its wall seconds and peak resident memory (VmHWM
read from /proc at exit; getrusage would include the process that forked it). Shared by the
real-size benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
import time

WRAPPER = """
import atexit, sys

def _report():
    peak = next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM'))
    sys.stderr.write('VMHWM %s\\n' % peak)
    torch = sys.modules.get('torch')
    if torch is not None and torch.cuda.is_initialized():  # the GPU's peak, where the command used one
        sys.stderr.write('CUDAPEAK %d\\n' % torch.cuda.max_memory_allocated())

atexit.register(_report)
from posterior_fusion.cli.main import main
main()
"""


def run_measured(*args) -> dict:
    """``{"exit", "seconds", "peak_mib", "gpu_peak_mib", "error", "stdout"}`` of ``pfuse ARGS…``
    (``gpu_peak_mib``: ``torch.cuda.max_memory_allocated`` where the command used the GPU, else None)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *map(str, args)], capture_output=True, text=True)
    peak = [int(ln.split()[1]) for ln in proc.stderr.splitlines() if ln.startswith("VMHWM ")]
    gpu = [int(ln.split()[1]) for ln in proc.stderr.splitlines() if ln.startswith("CUDAPEAK ")]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    return {"exit": proc.returncode, "seconds": round(time.time() - t0, 1),
            "peak_mib": round(peak[-1] / 1024) if peak else None,
            "gpu_peak_mib": round(gpu[-1] / 2**20) if gpu else None, "error": errors[-1][:200] if errors else None,
            "stdout": proc.stdout}


def sync() -> None:
    """Wait for the GPU's queued work (timings of GPU code around it); nothing without a GPU in use."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def paired_difference(diff: list[float]) -> str:
    """``"+m ± se"``: the mean of paired differences and its standard error (0 for one pair)."""
    import statistics

    se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else 0.0
    return f"{statistics.mean(diff):+.2f} ± {se:.2f}"


def save_rows(path: str | None, rows) -> None:
    """Write a benchmark's rows as indented JSON to ``path`` (its folder made), when one is given."""
    if path:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")
