"""Readers of the benchmark data sets' own binary formats (CIFAR-10's batches, SVHN's MATLAB files, IDX), each
checked against its header before any allocation."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np

from posterior_fusion import budget
from posterior_fusion.data.idx import read_idx
from posterior_fusion.errors import DataError, shown
from posterior_fusion.files import require_regular_file

IMPORT_OVERHEAD = 3               # the arrays read, their converted copy and the file written
_MAT_ITEMSIZE = {6: 8, 7: 4, 8: 1, 9: 1, 10: 2, 11: 2, 12: 4, 13: 4, 14: 8, 15: 8}  # MATLAB class -> bytes

def checked_labels(y, where: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or y.dtype.kind not in "iu" or (y.size and y.min() < 0):
        raise DataError(f"{where}: labels must be a 1-D array of non-negative integers, got {y.dtype} {y.shape}")
    return y.astype(np.int64)


def from_cifar10_binary(paths: list[Path], max_memory: int | str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10 *binary* batches (``data_batch_*.bin``, ``test_batch.bin``): records of 1 label
    byte + 3072 pixel bytes (R, G, B planes of 32x32)."""
    paths = [require_regular_file(p) for p in paths]
    if not paths:
        raise DataError("no CIFAR-10 binary batches (*_batch*.bin) found")
    budget.require(IMPORT_OVERHEAD * sum(p.stat().st_size for p in paths), f"importing {paths[0].parent}", max_memory)
    xs, ys = [], []
    for p in paths:
        raw = np.fromfile(p, dtype=np.uint8)
        if raw.size == 0 or raw.size % 3073:
            raise DataError(f"{p}: not a CIFAR-10 binary batch (size {raw.size} is not a multiple of 3073)")
        rec = raw.reshape(-1, 3073)
        if rec[:, 0].max() > 9:
            raise DataError(f"{p}: label byte above 9: not a CIFAR-10 binary batch")
        ys.append(rec[:, 0].astype(np.int64))
        xs.append(rec[:, 1:].reshape(-1, 3, 32, 32))
    return np.concatenate(xs), np.concatenate(ys)


def _mat_headers(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """``{name: (shape, bytes)}`` of a MATLAB v5 file's variables, from their headers alone: a
    compressed variable is inflated only as far as its header (a zlib bomb is never expanded)."""
    with path.open("rb") as fh:
        head = fh.read(128)
        if len(head) < 128 or head[126:128] not in (b"IM", b"MI"):
            raise DataError(f"{path}: not a MATLAB v5 file (v7.3 files are HDF5: export with -v7)")
        end = "<" if head[126:128] == b"IM" else ">"
        out: dict[str, tuple[tuple[int, ...], int]] = {}
        for _ in range(1000):
            tag = fh.read(8)
            if len(tag) < 8:
                return out
            kind, nbytes = struct.unpack(end + "II", tag)
            if kind == 15:  # miCOMPRESSED: inflate at most the variable's header
                inner = zlib.decompressobj().decompress(fh.read(min(nbytes, 4096)), 512)
                fh.seek(nbytes - min(nbytes, 4096), 1)
            elif kind == 14:  # miMATRIX
                inner = tag + fh.read(min(nbytes, 504))
                fh.seek(nbytes - min(nbytes, 504), 1)
            else:
                fh.seek(nbytes + (-nbytes % 8), 1)
                continue
            name, shape, cls = _mat_matrix_header(inner, end, path)
            out[name] = (shape, math.prod(shape) * _MAT_ITEMSIZE.get(cls, 8))
    raise DataError(f"{path}: more than 1000 variables")


def _mat_matrix_header(buf: bytes, end: str, path: Path) -> tuple[str, tuple[int, ...], int]:
    """Name, dimensions and class of one miMATRIX element from its first bytes."""
    try:
        kind, _ = struct.unpack_from(end + "II", buf, 0)
        if kind != 14:
            raise DataError(f"{path}: a compressed element that is not a matrix")
        flags = struct.unpack_from(end + "I", buf, 16)[0]
        dims_type, dims_bytes = struct.unpack_from(end + "II", buf, 24)
        if dims_type != 5 or not 8 <= dims_bytes <= 64:
            raise DataError(f"{path}: unexpected dimensions in a variable's header")
        shape = struct.unpack_from(end + f"{dims_bytes // 4}i", buf, 32)
        pos = 32 + dims_bytes + (-dims_bytes % 8)
        first = struct.unpack_from(end + "I", buf, pos)[0]
        if first >> 16:  # small data element: 2-byte size and type, 4 bytes of data
            name = buf[pos + 4 : pos + 4 + (first >> 16)]
        else:
            length = struct.unpack_from(end + "I", buf, pos + 4)[0]
            name = buf[pos + 8 : pos + 8 + min(length, 64)]
    except struct.error:
        raise DataError(f"{path}: truncated variable header") from None
    if min(shape, default=0) < 0:
        raise DataError(f"{path}: negative dimensions in a variable's header")
    return name.decode("latin-1"), tuple(shape), flags & 0xFF


def from_svhn_mat(path: Path, max_memory: int | str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """SVHN cropped digits (``train_32x32.mat``): ``X`` (32, 32, 3, n), ``y`` (n, 1) in 1..10 (10 = digit 0).
    The variables' shapes are read from their headers (:func:`_mat_headers`) and checked before loading."""
    from scipy.io import loadmat

    try:
        declared = _mat_headers(path)
        if "X" not in declared or "y" not in declared:
            raise DataError(f"{path}: expected variables X (32, 32, 3, n) and y (n, 1), found "
                            f"{', '.join(map(shown, declared)) or 'none'}")
        budget.require(IMPORT_OVERHEAD * (declared["X"][1] + declared["y"][1]), f"importing {path}", max_memory)
        mat = loadmat(path, variable_names=["X", "y"])
    except (OSError, ValueError, NotImplementedError) as exc:
        raise DataError(f"{path}: cannot read the MATLAB file ({exc})") from None
    if "X" not in mat or "y" not in mat or mat["X"].ndim != 4 or mat["X"].shape[:3] != (32, 32, 3):
        raise DataError(f"{path}: expected X (32, 32, 3, n) and y (n, 1)")
    x = np.ascontiguousarray(mat["X"].transpose(3, 2, 0, 1)).astype(np.uint8)
    y = mat["y"].reshape(-1).astype(np.int64)
    y[y == 10] = 0
    return x, checked_labels(y, str(path))


def from_idx(images: Path, labels: Path | None, max_memory: int | str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Any IDX pair (MNIST, Fashion-MNIST, KMNIST, EMNIST): ``*-images-idx3-ubyte[.gz]`` + labels."""
    x = read_idx(images, max_memory)
    y = read_idx(labels, max_memory).astype(np.int64) if labels else None
    if x.ndim < 2:
        raise DataError(f"{images}: IDX images must have rank 2 or more (n, ...), got shape {x.shape}")
    if y is not None and y.ndim != 1:
        raise DataError(f"{labels}: IDX labels must have rank 1, got shape {y.shape}")
    if y is not None and y.shape[0] != x.shape[0]:
        raise DataError(f"{images}: {x.shape[0]} images but {y.shape[0]} labels")
    return x, y
