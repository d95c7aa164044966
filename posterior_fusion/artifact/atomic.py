"""Atomic HDF5 writes: write a temporary file beside the target, then ``os.replace``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import h5py


def atomic_h5_write(path: str | os.PathLike, fill: Callable[[h5py.File], None]) -> None:
    """Create ``path`` by calling ``fill(file)`` on a temporary HDF5 file, then renaming it.

    A reader never sees a half-written file: either the old file (or none) or the new one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            fill(f)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
