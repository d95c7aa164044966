"""Silo / split data files (HDF5): ``/x`` uint8 or float32 images, ``/y`` int64 labels.

Root attributes: ``format = "posterior-fusion-data"``, ``format_version = 1``,
``dataset``, ``num_classes``. Images are normalised on load with the dataset's mean/std.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from posterior_fusion.artifact.atomic import atomic_h5_write
from posterior_fusion.errors import DataError

DATA_FORMAT = "posterior-fusion-data"
DATA_FORMAT_VERSION = 1
NORMALISATION = {"fmnist": (0.2860, 0.3530)}
MAX_SAMPLES = 10_000_000


@dataclass(frozen=True)
class SiloData:
    """One split: ``x`` ``(n, H, W)`` uint8 or float32, ``y`` ``(n,)`` int64."""

    x: np.ndarray
    y: np.ndarray
    dataset: str
    num_classes: int

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def class_counts(self) -> list[int]:
        return np.bincount(self.y, minlength=self.num_classes).astype(int).tolist()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised float32 inputs ``(n, 1, H, W)`` and int64 labels ``(n,)``."""
        x = torch.from_numpy(np.asarray(self.x, dtype=np.float32))
        if self.x.dtype == np.uint8:
            x = x / 255.0
        mean, std = NORMALISATION.get(self.dataset, (0.0, 1.0))
        x = (x - mean) / std
        if x.ndim == 3:
            x = x.unsqueeze(1)
        return x, torch.from_numpy(self.y.astype(np.int64))

    def sha256(self) -> str:
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.x).tobytes())
        h.update(np.ascontiguousarray(self.y).tobytes())
        return h.hexdigest()


def write_silo(path: str | os.PathLike, data: SiloData) -> None:
    """Write ``data`` atomically to ``path``."""
    def fill(f: h5py.File) -> None:
        f.attrs["format"] = DATA_FORMAT
        f.attrs["format_version"] = DATA_FORMAT_VERSION
        f.attrs["dataset"] = data.dataset
        f.attrs["num_classes"] = data.num_classes
        f.create_dataset("x", data=data.x, compression="gzip", compression_opts=4)
        f.create_dataset("y", data=data.y.astype(np.int64))

    atomic_h5_write(path, fill)


def read_silo(path: str | os.PathLike, num_classes: int | None = None) -> SiloData:
    """Read and validate a data file; labels must lie in ``[0, num_classes)``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != DATA_FORMAT:
                raise DataError(f"{path}: not a posterior-fusion data file (missing format attribute)")
            if int(f.attrs.get("format_version", -1)) != DATA_FORMAT_VERSION:
                raise DataError(f"{path}: unsupported data format_version {f.attrs.get('format_version')}")
            for key in ("x", "y"):
                if key not in f or not isinstance(f.get(key, getlink=True), h5py.HardLink):
                    raise DataError(f"{path}: missing dataset /{key}")
            xd, yd = f["x"], f["y"]
            if xd.dtype not in (np.uint8, np.float32) or xd.ndim not in (2, 3, 4):
                raise DataError(f"{path} [/x]: expected uint8/float32 of rank 2-4, got {xd.dtype} {xd.shape}")
            if yd.dtype != np.int64 or yd.ndim != 1 or yd.shape[0] != xd.shape[0]:
                raise DataError(f"{path} [/y]: expected int64 (n,) matching /x, got {yd.dtype} {yd.shape}")
            if xd.shape[0] > MAX_SAMPLES or xd.size > MAX_SAMPLES * 3 * 32 * 32:
                raise DataError(f"{path} [/x]: {xd.shape} exceeds the size cap")
            dataset = str(f.attrs.get("dataset", "unknown"))
            k = int(f.attrs.get("num_classes", 0))
            x, y = xd[()], yd[()]
    except OSError as exc:
        raise DataError(f"{path}: not a readable HDF5 data file ({exc})") from None
    k = num_classes if num_classes is not None else k
    if k < 1:
        raise DataError(f"{path}: num_classes missing or invalid")
    if y.size and (y.min() < 0 or y.max() >= k):
        raise DataError(f"{path} [/y]: labels must be in [0, {k}), found range [{y.min()}, {y.max()}]")
    if x.dtype == np.float32 and not np.isfinite(x).all():
        raise DataError(f"{path} [/x]: contains NaN or Inf")
    return SiloData(x, y, dataset, k)
