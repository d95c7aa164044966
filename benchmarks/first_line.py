"""Time to the first stdout line and to the end of a command (3 runs):

    .venv/bin/python benchmarks/first_line.py .venv/bin/pfuse inspect FILE
"""

from __future__ import annotations

import subprocess
import sys
import time

if __name__ == "__main__":
    cmd = sys.argv[1:]
    for _ in range(3):
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        p.stdout.readline()
        t1 = time.perf_counter()
        p.communicate()
        t2 = time.perf_counter()
        print(f"first line {t1 - t0:.2f}s, whole command {t2 - t0:.2f}s (exit {p.returncode})")
