"""Turn common data formats into the documented silo file (``pfuse import-data``).

Every importer returns ``(x, y)``: ``x`` uint8 images ``(n, H, W)`` / ``(n, C, H, W)`` (channel
first) or float32 vectors ``(n, F)``; ``y`` int64 labels ``(n,)`` (or ``None`` for unlabelled
files). Nothing is unpickled: CIFAR-10 is read from its *binary* distribution, SVHN from its
MATLAB files through scipy, NumPy files with ``allow_pickle=False``.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from posterior_fusion.data.idx import read_idx
from posterior_fusion.errors import DataError
from posterior_fusion.storage import read_native, storage_problem

MAX_ROWS = 10_000_000
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def _labels(y, where: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or y.dtype.kind not in "iu" or (y.size and y.min() < 0):
        raise DataError(f"{where}: labels must be a 1-D array of non-negative integers, got {y.dtype} {y.shape}")
    return y.astype(np.int64)


def _inputs(x, where: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim not in (2, 3, 4) or x.shape[0] < 1:
        raise DataError(f"{where}: inputs must be (n, F), (n, H, W) or (n, C, H, W), got {x.shape}")
    if x.dtype == np.uint8:
        return x
    if x.dtype.kind not in "fiu":
        raise DataError(f"{where}: inputs must be numeric, got {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise DataError(f"{where}: inputs contain NaN or Inf")
    return x


def from_npz(path: Path, x_key: str = "x", y_key: str = "y") -> tuple[np.ndarray, np.ndarray | None]:
    """A ``.npz`` archive with arrays ``x_key`` and (optionally) ``y_key``."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if x_key not in z.files:
                raise DataError(f"{path}: no array {x_key!r} (has {', '.join(z.files)})")
            x = _inputs(z[x_key], f"{path} [{x_key}]")
            y = _labels(z[y_key], f"{path} [{y_key}]") if y_key in z.files else None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read .npz ({exc})") from None
    return x, y


def from_npy(path: Path, labels: Path | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """An ``.npy`` inputs file plus an optional ``.npy`` labels file."""
    try:
        x = _inputs(np.load(path, allow_pickle=False), str(path))
        y = _labels(np.load(labels, allow_pickle=False), str(labels)) if labels else None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read .npy ({exc})") from None
    return x, y


def from_csv(path: Path, label_column: str = "label") -> tuple[np.ndarray, np.ndarray | None]:
    """A CSV file with a header row; ``label_column`` holds integer labels (or class names,
    mapped to 0..K-1 in sorted order); every other column must be numeric."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: cannot read CSV ({exc})") from None
    if len(rows) < 2:
        raise DataError(f"{path}: a header row and at least one data row are needed")
    header, body = rows[0], rows[1:]
    if len(body) > MAX_ROWS:
        raise DataError(f"{path}: more than {MAX_ROWS} rows")
    has_label = label_column in header
    li = header.index(label_column) if has_label else None
    feats = [i for i in range(len(header)) if i != li]
    try:
        x = np.array([[float(r[i]) for i in feats] for r in body], dtype=np.float32)
    except (ValueError, IndexError) as exc:
        raise DataError(f"{path}: every feature must be numeric and every row complete ({exc})") from None
    if not has_label:
        return _inputs(x, str(path)), None
    raw = [r[li] for r in body]
    try:
        y = np.array([int(v) for v in raw], dtype=np.int64)
    except ValueError:
        names = sorted(set(raw))
        y = np.array([names.index(v) for v in raw], dtype=np.int64)
    return _inputs(x, str(path)), _labels(y, str(path))


def from_image_folder(path: Path, size: tuple[int, int] | None = None, grey: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``path/<class>/<image>``: one sub-folder per class (sorted names = labels 0..K-1), read with
    Pillow; RGB (or grey) uint8, resized to ``size`` (default: the first image's size)."""
    from PIL import Image, UnidentifiedImageError

    classes = sorted(p for p in path.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{path}: no class sub-folders")
    xs, ys = [], []
    for label, folder in enumerate(classes):
        for f in sorted(folder.iterdir()):
            if f.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            try:
                with Image.open(f) as im:
                    im = im.convert("L" if grey else "RGB")
                    if size is None:
                        size = im.size
                    if im.size != size:
                        im = im.resize(size)
                    arr = np.asarray(im, dtype=np.uint8)
            except (OSError, UnidentifiedImageError) as exc:
                raise DataError(f"{f}: cannot read image ({exc})") from None
            xs.append(arr if grey else arr.transpose(2, 0, 1))
            ys.append(label)
    if not xs:
        raise DataError(f"{path}: no images found")
    return np.stack(xs), np.array(ys, dtype=np.int64)


def from_hdf5(path: Path, x_key: str = "x", y_key: str = "y") -> tuple[np.ndarray, np.ndarray | None]:
    """A plain HDF5 file with datasets ``x_key`` and (optionally) ``y_key`` (same storage checks as silos)."""
    try:
        with h5py.File(path, "r") as f:
            if x_key not in f or not isinstance(f[x_key], h5py.Dataset):
                raise DataError(f"{path}: no dataset /{x_key}")
            out = []
            for key in (x_key, y_key):
                if key == y_key and key not in f:
                    out.append(None)
                    continue
                ds = f[key]
                if not isinstance(f.get(key, getlink=True), h5py.HardLink) or storage_problem(ds):
                    raise DataError(f"{path} [/{key}]: {storage_problem(ds) or 'links are not allowed'}")
                if ds.size > MAX_ROWS * 3 * 256 * 256:
                    raise DataError(f"{path} [/{key}]: {ds.shape} exceeds the size cap")
                out.append(read_native(ds))
    except OSError as exc:
        raise DataError(f"{path}: cannot read HDF5 ({exc})") from None
    return _inputs(out[0], f"{path} [/{x_key}]"), None if out[1] is None else _labels(out[1], f"{path} [/{y_key}]")


def from_cifar10_binary(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10 *binary* batches (``data_batch_*.bin``, ``test_batch.bin``): records of 1 label
    byte + 3072 pixel bytes (R, G, B planes of 32x32)."""
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


def from_svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """SVHN cropped digits (``train_32x32.mat``): ``X`` (32, 32, 3, n), ``y`` (n, 1) in 1..10 (10 = digit 0)."""
    from scipy.io import loadmat

    try:
        mat = loadmat(path)
    except (OSError, ValueError, NotImplementedError) as exc:
        raise DataError(f"{path}: cannot read the MATLAB file ({exc})") from None
    if "X" not in mat or "y" not in mat or mat["X"].ndim != 4 or mat["X"].shape[:3] != (32, 32, 3):
        raise DataError(f"{path}: expected X (32, 32, 3, n) and y (n, 1)")
    x = np.ascontiguousarray(mat["X"].transpose(3, 2, 0, 1)).astype(np.uint8)
    y = mat["y"].reshape(-1).astype(np.int64)
    y[y == 10] = 0
    return x, _labels(y, str(path))


def from_idx(images: Path, labels: Path | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Any IDX pair (MNIST, Fashion-MNIST, KMNIST, EMNIST): ``*-images-idx3-ubyte[.gz]`` + labels."""
    x = read_idx(images)
    y = read_idx(labels).astype(np.int64) if labels else None
    if y is not None and y.shape[0] != x.shape[0]:
        raise DataError(f"{images}: {x.shape[0]} images but {y.shape[0]} labels")
    return x, y


def from_sklearn(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Real data sets shipped inside scikit-learn's wheel: ``digits`` (8x8 images), ``breast_cancer``, ``wine``."""
    try:
        from sklearn import datasets
    except ImportError:
        raise DataError("sklearn:* sources need scikit-learn (pip install 'posterior-fusion[data]')") from None
    loaders: dict[str, Callable] = {"digits": datasets.load_digits, "breast_cancer": datasets.load_breast_cancer,
                                    "wine": datasets.load_wine}
    if name not in loaders:
        raise DataError(f"unknown scikit-learn data set {name!r}; available: {', '.join(loaders)}")
    d = loaders[name]()
    if name == "digits":  # 0..16 grey levels -> uint8 images
        return (d.images * (255 / 16)).round().astype(np.uint8), d.target.astype(np.int64)
    return d.data.astype(np.float32), d.target.astype(np.int64)


FORMATS = ("npz", "npy", "csv", "image-folder", "hdf5", "cifar10", "svhn", "idx", "sklearn")


def detect_format(source: str) -> str:
    if source.startswith("sklearn:"):
        return "sklearn"
    p = Path(source)
    if p.is_dir():
        if list(p.glob("*_batch*.bin")):
            return "cifar10"
        return "image-folder"
    suffix = "".join(p.suffixes[-2:]) if p.suffix == ".gz" else p.suffix
    table = {".npz": "npz", ".npy": "npy", ".csv": "csv", ".h5": "hdf5", ".hdf5": "hdf5", ".mat": "svhn",
             ".bin": "cifar10"}
    if suffix in table:
        return table[suffix]
    if "idx" in p.name:
        return "idx"
    raise DataError(f"{source}: cannot tell the format from the name; pass --format ({', '.join(FORMATS)})")


def load_source(source: str, fmt: str = "auto", labels: str | os.PathLike | None = None, label_column: str = "label",
                x_key: str = "x", y_key: str = "y", size: tuple[int, int] | None = None,
                grey: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Read ``source`` in format ``fmt`` (``auto``: from its name) into ``(x, y)``."""
    fmt = detect_format(source) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "sklearn":
        return from_sklearn(source.split(":", 1)[1] if ":" in source else source)
    p = Path(source)
    if not p.exists():
        raise DataError(f"{p}: not found")
    lab = Path(labels) if labels else None
    if fmt == "npz":
        return from_npz(p, x_key, y_key)
    if fmt == "npy":
        return from_npy(p, lab)
    if fmt == "csv":
        return from_csv(p, label_column)
    if fmt == "image-folder":
        return from_image_folder(p, size, grey)
    if fmt == "hdf5":
        return from_hdf5(p, x_key, y_key)
    if fmt == "cifar10":
        files = sorted(p.glob("*_batch*.bin")) if p.is_dir() else [p]
        return from_cifar10_binary(files)
    if fmt == "svhn":
        return from_svhn_mat(p)
    return from_idx(p, lab)
