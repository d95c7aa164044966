"""Peak memory of every fusion method on compressed artifacts whose dense factors dwarf what is stored,
against the memory estimate ``fuse`` checks before it loads anything (docs/security.md): three clients,
M = 2, an ``mlp`` with ``--in-features`` inputs, 10 classes and no hidden layer, each Kronecker block
isotropic (stored at rank 0: a few hundred kB, the dense input factor in² floats). Each method runs
in a fresh ``pfuse fuse`` process; its peak is VmHWM above the start-up, measured by the same command
refused at half its estimate (headers read, everything imported, nothing loaded).

    .venv/bin/python benchmarks/compact_memory.py --in-features 2048 --json docs/results/compact_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.artifact.reader import declared_bytes
from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.curvature.compressed import Compression
from posterior_fusion.experiment.measure import save_rows
from posterior_fusion.fusion.registry import METHODS
from posterior_fusion.fusion.resources import estimate_fuse_bytes
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component, frozen_mapping

PEAK = ("import sys, atexit; atexit.register(lambda: sys.stderr.write('PEAK %s\\n' % next(l.split()[1] for l in "
        "open('/proc/self/status') if l.startswith('VmHWM')))); from posterior_fusion.cli.main import main; main()")
METHODS_RUN = ("fedavg", "fisher-merge", "fedfisher", "regmean", "fedlpa", "hbfl", "ensemble", "fedbens")


def clients(folder: Path, inputs: int) -> list[Path]:
    spec = ModelSpec("mlp", {"in_features": inputs, "num_classes": 10, "hidden_sizes": [], "bias": False})
    layout = ParameterLayout.from_model(spec.build())
    gen = torch.Generator().manual_seed(0)
    meta = {"n_data": 100, "class_counts": [10] * 10, "temperature": 1.0, "prior_precision": 1.0, "structure": "kron"}
    paths = []
    for c in range(3):
        comps = [Component(m, 0.01 * torch.randn(layout.dim, generator=gen),
                           BlockDiag([Kron(5.0 * torch.eye(10), 0.5 * torch.eye(inputs))]), frozen_mapping({"seed": m}),
                           1.0, 1.0) for m in range(2)]
        paths.append(folder / f"c{c}.h5")
        write_client_artifact(paths[-1], spec, layout, meta, comps, Compression(0.05))
    return paths


def peak(args: list[str]) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK, *args], capture_output=True, text=True)
    kb = next(int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("PEAK"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    return kb * 1024, time.perf_counter() - t0, errors[0] if errors else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-features", type=int, default=2048, help="inputs of the mlp [default: 2048]")
    ap.add_argument("--json", default=None, help="write the rows here [default: print only]")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = clients(folder, args.in_features)
        headers = [declared_bytes(p) for p in paths]
        rows = []
        for method in METHODS_RUN:
            settings = METHODS[method].settings()
            estimate = estimate_fuse_bytes(headers, method, settings)
            used, seconds, error = peak(["-q", "fuse", *map(str, paths), "--method", method, "--max-memory", "100G",
                                         "--out", str(folder / "g.h5")])
            refused, _, why = peak(["-q", "fuse", *map(str, paths), "--method", method,
                                    "--max-memory", str(max(estimate // 2, 1)), "--out", str(folder / "r.h5")])
            # the refused run read the headers and imported everything, then stopped: the start-up
            rows.append({"method": method, "stored_mib": sum(h["data_bytes"] for h in headers) / 2**20,
                         "dense_mib": sum(h["dense_bytes"] for h in headers) / 2**20,
                         "estimate_mib": estimate / 2**20, "peak_above_start_mib": (used - refused) / 2**20,
                         "seconds": round(seconds, 1), "error": error,
                         "refused_at_half_the_estimate": bool(why) and not (folder / "r.h5").exists(),
                         "start_mib": refused / 2**20})
            print(json.dumps(rows[-1]), flush=True)
    save_rows(args.json, {"in_features": args.in_features, "rows": rows})


if __name__ == "__main__":
    main()
