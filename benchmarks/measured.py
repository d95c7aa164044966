"""One ``pfuse`` command in a fresh process with its wall seconds and peak resident memory (VmHWM
read from /proc at exit; getrusage would include the process that forked it). Shared by the
real-size benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
import time

WRAPPER = ("import sys, atexit; atexit.register(lambda: sys.stderr.write('VMHWM %s\\n' % next("
           "l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))); "
           "from posterior_fusion.cli.main import main; main()")


def run_measured(*args) -> dict:
    """``{"exit", "seconds", "peak_mib", "error", "stdout"}`` of ``pfuse ARGS…``."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *map(str, args)], capture_output=True, text=True)
    peak = [int(ln.split()[1]) for ln in proc.stderr.splitlines() if ln.startswith("VMHWM ")]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    return {"exit": proc.returncode, "seconds": round(time.time() - t0, 1),
            "peak_mib": round(peak[-1] / 1024) if peak else None, "error": errors[-1][:200] if errors else None,
            "stdout": proc.stdout}


def save_rows(path: str | None, rows) -> None:
    """Write a benchmark's rows as indented JSON to ``path`` (its folder made), when one is given."""
    if path:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")
