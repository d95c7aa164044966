"""How the server's cost grows with the federation: ``pfuse fuse`` on C LeNet client artifacts, C ∈ ``--clients``,
per method, each fusion in a fresh process (wall seconds, peak resident memory), and the growth exponent of each
fitted on log-log axes.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/federation_size.py --clients 5 20 100 \\
        --work runs/federation_size --json docs/results/federation_size/fuse.json

Silos: ``--silo-size`` images each (200) drawn from Fashion-MNIST's training set (the full set where Debian's
``dataset-fashion-mnist`` is installed, else the embedded subset), class proportions Dirichlet(``--alpha``) per
silo, silos drawn independently (they may share images once C × size passes the set). Each silo is fitted once,
LeNet, M = 2, ``--epochs`` epochs, kron (``local.fit.fit_local``), and cached under ``--work``: the first C
silos of the largest C serve every smaller C. Server data: 1,000 held-out test images as the unlabeled set of
the distilled rows (``--distill-steps`` steps of the consistent recipe; its default 3,000 steps drawn from 8
cached views of each input; FedBE's recipe) and 500 as fedbens' validation set.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR, find_fmnist_dir, load_fmnist
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.experiment.measure import run_measured, save_rows
from posterior_fusion.local.fit import Start, fit_local
from posterior_fusion.local.fit_config import fit_config_from
from posterior_fusion.models import ModelSpec

METHODS = {  # row name -> fuse arguments (besides the files and --out)
    "pool (default)": [],
    "pool distilled": ["--distill", "--unlabeled", "{unlabeled}", "--distill-steps", "{steps}"],
    "pool distilled (swa)": ["--distill", "--distill-recipe", "swa", "--unlabeled", "{unlabeled}"],
    "pool distilled (8 cached views)": ["--distill", "--unlabeled", "{unlabeled}", "--distill-views", "8"],
    "fedavg": ["--method", "fedavg"],
    "fisher-merge": ["--method", "fisher-merge"],
    "fedbens": ["--method", "fedbens", "--val", "{val}"],
    "fedlpa": ["--method", "fedlpa"],
}


def silos(work: Path, count: int, size: int, alpha: float) -> list[Path]:
    """The first ``count`` silo files (written once, in a fixed order from seed 0)."""
    folder = find_fmnist_dir() or EMBEDDED_FMNIST_DIR
    x, y = load_fmnist("train", folder)
    rng = np.random.default_rng(0)
    by_class = [np.flatnonzero(y == k) for k in range(10)]
    paths = []
    for c in range(count):
        path = work / "silos" / f"silo_{c}.h5"
        props = rng.dirichlet(np.full(10, alpha))
        counts = rng.multinomial(size, props)
        idx = np.concatenate([rng.choice(by_class[k], n, replace=False) for k, n in enumerate(counts) if n])
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_silo(path, SiloData(x[idx], y[idx], "fmnist", 10))
        paths.append(path)
    return paths


def server_files(work: Path) -> tuple[Path, Path]:
    folder = find_fmnist_dir() or EMBEDDED_FMNIST_DIR
    x, y = load_fmnist("test", folder)
    unlabeled, val = work / "server_unlabeled.h5", work / "server_val.h5"
    if not unlabeled.exists():
        write_silo(unlabeled, SiloData(x[:1000], None, "fmnist", 10))
        write_silo(val, SiloData(x[1000:1500], y[1000:1500], "fmnist", 10))
    return unlabeled, val


def artifacts(work: Path, silo_paths: list[Path], epochs: int) -> list[Path]:
    spec = ModelSpec("lenet", {})
    cfg = fit_config_from({"structure": "kron", "epochs": epochs})
    out = []
    for c, silo in enumerate(silo_paths):
        path = work / "clients" / f"post_{c}.h5"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fit_local(spec, silo, Start(init_seed=0, components=2), cfg, path, log=lambda m: None)
            print(f"fitted client {c + 1}/{len(silo_paths)}", flush=True)
        out.append(path)
    return out


def exponent(cs: list[int], values: list[float]) -> float | None:
    """The slope of log(value) against log(C) (least squares), or None with fewer than two points."""
    pts = [(math.log(c), math.log(v)) for c, v in zip(cs, values) if v and v > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    return sum((a - mx) * (b - my) for a, b in pts) / sum((a - mx) ** 2 for a, _ in pts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[5, 20, 100, 500], help="the federation sizes C")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--silo-size", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--distill-steps", type=int, default=300)
    ap.add_argument("--work", type=Path, default=Path("runs/federation_size"))
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    paths = artifacts(args.work, silos(args.work, max(args.clients), args.silo_size, args.alpha), args.epochs)
    unlabeled, val = server_files(args.work)
    rows = []
    for method in args.methods:
        seconds, peaks = [], []
        for c in sorted(args.clients):
            extra = [a.format(unlabeled=unlabeled, val=val, steps=args.distill_steps) for a in METHODS[method]]
            out = args.work / "globals" / f"{method.split()[0]}_{'d' if 'distilled' in method else ''}{c}.h5"
            out.parent.mkdir(parents=True, exist_ok=True)
            r = run_measured("-q", "fuse", *paths[:c], *extra, "--out", out)
            row = {"method": method, "clients": c, "exit": r["exit"], "seconds": r["seconds"], "peak_mib": r["peak_mib"],
                   "artifact_mib": round(sum(p.stat().st_size for p in paths[:c]) / 2**20, 1), "error": r["error"]}
            rows.append(row)
            print(row, flush=True)
            if r["exit"] == 0:
                seconds.append((c, r["seconds"]))
                peaks.append((c, r["peak_mib"]))
        rows.append({"method": method, "time_exponent": exponent([c for c, _ in seconds], [s for _, s in seconds]),
                     "memory_exponent": exponent([c for c, _ in peaks], [p for _, p in peaks])})
        print(rows[-1], flush=True)
        save_rows(args.json, rows)
    save_rows(args.json, rows)


if __name__ == "__main__":
    main()
