"""Reader for the IDX format (MNIST / Fashion-MNIST ``*-ubyte.gz`` files)."""

from __future__ import annotations

import gzip
import math
import os
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

from posterior_fusion import budget
from posterior_fusion.errors import DataError
from posterior_fusion.files import require_regular_file

SYSTEM_FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_IN_REPO = Path(__file__).resolve().parents[2] / "data" / "fashion-mnist-subset"
_INSTALLED = Path(sys.prefix) / "share" / "posterior-fusion" / "fashion-mnist-subset"
# The embedded subset: the checkout's data/ folder, else where a wheel install puts it.
EMBEDDED_FMNIST_DIR = _IN_REPO if (_IN_REPO / "train-images-idx3-ubyte.gz").exists() else _INSTALLED
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
MAX_IDX_ITEMS = 10_000_000


def read_idx(path: Path, max_memory: int | str | None = None) -> np.ndarray:
    """Read one IDX file of unsigned bytes (gzip-compressed or plain); returns ``(n, ...)`` uint8.

    The header is read first and the declared size checked against the caps and the memory
    budget; the data is then streamed, so a gzip bomb never decompresses beyond its header's size."""
    path = require_regular_file(path, "IDX file")
    with path.open("rb") as probe:
        compressed = probe.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rb") if compressed else path.open("rb")) as fh:
            head = fh.read(4)
            if len(head) < 4:
                raise DataError(f"{path}: truncated IDX header")
            zero, dtype_code, ndim = struct.unpack(">HBB", head)
            if zero != 0 or dtype_code != 0x08 or not 1 <= ndim <= 4:
                raise DataError(f"{path}: not an unsigned-byte IDX file")
            raw_dims = fh.read(4 * ndim)
            if len(raw_dims) < 4 * ndim:
                raise DataError(f"{path}: truncated IDX header")
            dims = struct.unpack(f">{ndim}I", raw_dims)
            count = math.prod(dims)  # Python integers: no overflow
            if count == 0 or count > MAX_IDX_ITEMS * 784:
                raise DataError(f"{path}: IDX header declares {dims}: empty or over the size cap")
            budget.require(2 * count, f"reading {path}", max_memory)
            data = fh.read(count)
            if len(data) != count or fh.read(1):
                raise DataError(f"{path}: IDX size does not match its header {dims}")
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: cannot read IDX file ({exc})") from None
    return np.frombuffer(data, dtype=np.uint8).reshape(dims).copy()


def find_fmnist_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """``data_dir`` if given, else the Debian package's folder, else the embedded subset."""
    if data_dir is not None:
        return Path(data_dir)
    if all((SYSTEM_FMNIST_DIR / f).exists() for pair in FILES.values() for f in pair):
        return SYSTEM_FMNIST_DIR
    return EMBEDDED_FMNIST_DIR


def load_fmnist(split: str, data_dir: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST ``split`` ('train' or 'test'): images ``(n, 28, 28)`` uint8, labels ``(n,)`` int64."""
    if split not in FILES:
        raise DataError(f"unknown split {split!r}; use 'train' or 'test'")
    folder = find_fmnist_dir(data_dir)
    images_name, labels_name = FILES[split]
    for name in (images_name, labels_name):
        if not (folder / name).exists():
            raise DataError(f"{folder / name} not found (install 'dataset-fashion-mnist' or pass `data_dir`)")
    x = read_idx(folder / images_name)
    y = read_idx(folder / labels_name).astype(np.int64)
    if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise DataError(f"{folder}: images {x.shape} and labels {y.shape} do not match")
    return x, y
