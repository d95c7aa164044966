"""Regenerate data/fashion-mnist-subset/ from the full Fashion-MNIST (Debian package).

    python scripts/make_fmnist_subset.py [--train 6000] [--test 1000] [--seed 0]

Samples are drawn uniformly at random (seeded) and written in the original IDX .gz format,
so the same loader reads the subset and the full data set.
"""

from __future__ import annotations

import argparse
import gzip
import struct
from pathlib import Path

import numpy as np

from posterior_fusion.data.idx import FILES, SYSTEM_FMNIST_DIR, read_idx

OUT = Path(__file__).resolve().parents[1] / "data" / "fashion-mnist-subset"


def write_idx(path: Path, arr: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as fh:
        fh.write(header + arr.astype(np.uint8).tobytes())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    OUT.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.train), ("test", args.test)):
        images_name, labels_name = FILES[split]
        x = read_idx(SYSTEM_FMNIST_DIR / images_name)
        y = read_idx(SYSTEM_FMNIST_DIR / labels_name)
        idx = np.sort(rng.choice(len(y), size=n, replace=False))
        write_idx(OUT / images_name, x[idx])
        write_idx(OUT / labels_name, y[idx])
        print(f"{split}: {n} samples, class counts {np.bincount(y[idx], minlength=10).tolist()}")


if __name__ == "__main__":
    main()
