"""Time to the first stdout line and to the end of a command (3 runs):

    .venv/bin/python benchmarks/first_line.py .venv/bin/pfuse inspect FILE
"""

from __future__ import annotations

import argparse
import subprocess
import time

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to time, with its arguments")
    cmd = ap.parse_args().command
    for _ in range(3):
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        p.stdout.readline()
        t1 = time.perf_counter()
        p.communicate()
        t2 = time.perf_counter()
        print(f"first line {t1 - t0:.2f}s, whole command {t2 - t0:.2f}s (exit {p.returncode})")
