"""What the benchmarks and studies share to measure: one ``pfuse`` command in a fresh process with
its wall seconds and peak resident memory (VmHWM read from /proc at exit; getrusage would include
the process that forked it), a device sync, a paired difference's summary, rows saved as JSON, and
scikit-learn's digits as an out-of-distribution set for Fashion-MNIST models."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from posterior_fusion.data.silo import SiloData, read_silo, write_silo

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


def digits_ood(path: Path) -> SiloData:
    """scikit-learn's 1,797 digits, resized to 28 × 28 greyscale, written as a silo file at ``path`` and read
    back: an out-of-distribution set for models trained on Fashion-MNIST."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    x = torch.nn.functional.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)[:, 0]
    silo = SiloData((x.clamp(0, 1) * 255).round().to(torch.uint8).numpy(), d.target.astype(np.int64), "fmnist", 10)
    write_silo(path, silo)
    return read_silo(path)
