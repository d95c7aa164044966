"""Turn common data formats into the documented silo file (``pfuse import-data``).

Every importer returns ``(x, y)``: ``x`` uint8 images ``(n, H, W)`` / ``(n, C, H, W)`` (channel
first) or float32 vectors ``(n, F)``; ``y`` int64 labels ``(n,)`` (or ``None`` for unlabelled
files). Nothing is unpickled: CIFAR-10 is read from its *binary* distribution, SVHN from its
MATLAB files through scipy, NumPy files with ``allow_pickle=False``.
"""

from __future__ import annotations

import csv
import math
import os
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from posterior_fusion import budget
from posterior_fusion.data.benchmark_formats import (
    IMPORT_OVERHEAD,
    checked_labels,
    from_cifar10_binary,
    from_idx,
    from_svhn_mat,
)
from posterior_fusion.errors import DataError, ResourceLimitError, shown
from posterior_fusion.files import regular_files_in, require_regular_file, subfolders
from posterior_fusion.hdf5_safety import plain_dataset_problem, read_native

MAX_ROWS = 10_000_000


MAX_LABEL = 100_000 - 1           # data files hold at most 100,000 classes


MAX_IMAGE_SIDE = 8192




CSV_BYTES_PER_FILE_BYTE = 40      # Python rows of strings and floats per byte of CSV text


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}




class IntegerInputs(UserWarning):
    """Inputs stored as integers other than uint8 images (token ids, typically), converted to float32 exactly;
    :func:`~posterior_fusion.data.prepare.import_data` says so where its transform would standardise them."""


def _inputs(x, where: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim not in (2, 3, 4) or x.shape[0] < 1:
        raise DataError(f"{where}: inputs must be (n, F), (n, H, W) or (n, C, H, W), got {x.shape}")
    if x.dtype == np.uint8:
        return x
    if x.dtype.kind not in "fiu":
        raise DataError(f"{where}: inputs must be numeric, got {x.dtype}")
    if x.dtype.kind in "iu":
        warnings.warn(f"{where}: inputs are {x.dtype} integers", IntegerInputs, stacklevel=2)
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise DataError(f"{where}: inputs contain NaN or Inf")
    return x


def _npy_bytes(fh, where: str) -> int:
    """Bytes an ``.npy`` stream declares in its header (read without reading the data)."""
    version = np.lib.format.read_magic(fh)
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise DataError(f"{where}: unsupported .npy version {version}")
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = reader(fh, max_header_size=10_000)
    if dtype.hasobject:
        raise DataError(f"{where}: cannot read an object array (pickled objects are never loaded)")
    return math.prod(shape) * dtype.itemsize


def from_npz(path: Path, x_key: str = "x", y_key: str = "y",
             max_memory: int | str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """A ``.npz`` archive with arrays ``x_key`` and (optionally) ``y_key``; every member's size is
    read from its ``.npy`` header and checked against the budget before it is decompressed."""
    try:
        with zipfile.ZipFile(path) as zf:
            need = 0
            for key in (x_key, y_key):
                if f"{key}.npy" in zf.namelist():
                    with zf.open(f"{key}.npy") as fh:
                        need += _npy_bytes(fh, f"{path} [{key}]")
        budget.require(IMPORT_OVERHEAD * need, f"importing {path}", max_memory)
        with np.load(path, allow_pickle=False) as z:
            if x_key not in z.files:
                raise DataError(f"{path}: no array {x_key!r} (has {', '.join(z.files)})")
            x = _inputs(z[x_key], f"{path} [{x_key}]")
            y = checked_labels(z[y_key], f"{path} [{y_key}]") if y_key in z.files else None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read .npz ({exc})") from None
    return x, y


def from_npy(path: Path, labels: Path | None = None,
             max_memory: int | str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """An ``.npy`` inputs file plus an optional ``.npy`` labels file (sizes from headers first)."""
    try:
        need = 0
        for p in (path, labels):
            if p is not None:
                with open(require_regular_file(p), "rb") as fh:
                    need += _npy_bytes(fh, str(p))
        budget.require(IMPORT_OVERHEAD * need, f"importing {path}", max_memory)
        x = _inputs(np.load(path, allow_pickle=False), str(path))
        y = checked_labels(np.load(labels, allow_pickle=False), str(labels)) if labels else None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read .npy ({exc})") from None
    return x, y


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def from_csv(path: Path, label_column: str = "label",
             max_memory: int | str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """A CSV file with a header row; ``label_column`` holds integer labels (or class names,
    mapped to 0..K-1 in sorted order); every other column must be numeric."""
    budget.require(CSV_BYTES_PER_FILE_BYTE * path.stat().st_size, f"importing {path}", max_memory)
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
    short = next((i for i, r in enumerate(body) if len(r) != len(header)), None)
    if short is not None:
        raise DataError(f"{path}: row {short + 2} has {len(body[short])} fields, the header {len(header)}")
    has_label = label_column in header
    columns = ", ".join(repr(h) for h in header[:20]) + (", …" if len(header) > 20 else "")
    if not has_label and label_column != "label":  # a label column named on purpose must exist
        raise DataError(f"{path}: no column {shown(label_column)} (`label_column`); the columns are {columns}")
    li = header.index(label_column) if has_label else None
    feats = [i for i in range(len(header)) if i != li]
    try:
        x = np.array([[float(r[i]) for i in feats] for r in body], dtype=np.float32)
    except ValueError as exc:
        bad = next((header[i] for i in feats if not all(_is_float(r[i]) for r in body)), "?")
        hint = "" if has_label else f"; no column {shown(label_column)} holds the labels — name it with `label_column`"
        raise DataError(f"{path}: column {shown(bad)} is not numeric ({exc}){hint}") from None
    if not has_label:
        return _inputs(x, str(path)), None
    raw = [r[li] for r in body]
    try:
        ints = [int(v) for v in raw]
    except ValueError:  # class names: 0..K-1 in sorted order (a dict: linear in the number of rows)
        numbers = [i for i, v in enumerate(raw) if is_int(v)]
        if numbers:  # integer labels with a stray value: refused, never renumbered as names
            odd = next(i for i, v in enumerate(raw) if not is_int(v))
            raise DataError(f"{path}: column {shown(label_column)} holds integer labels and other values (row "
                            f"{odd + 2}: {shown(raw[odd], 40)}); fix or drop those rows — labels are read as written") from None
        index = {name: i for i, name in enumerate(sorted(set(raw)))}
        ints = [index[v] for v in raw]
    if ints and not 0 <= min(ints) <= max(ints) <= MAX_LABEL:
        raise DataError(f"{path}: labels must be integers in [0, {MAX_LABEL}], found [{min(ints)}, {max(ints)}]")
    return _inputs(x, str(path)), checked_labels(np.array(ints, dtype=np.int64), str(path))


GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")  # Pillow modes with one colour channel


def _image_header(f: Path) -> tuple[int, int, str]:
    """An image's declared (width, height) and Pillow mode, read from its header only."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(f) as im:
            return (*im.size, im.mode)
    except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise DataError(f"{f}: cannot read image ({exc})") from None


def from_image_folder(path: Path, size: tuple[int, int] | None = None, grey: bool | None = None,
                      max_memory: int | str | None = None,
                      follow_links: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``path/<class>/<image>``: one sub-folder per class (sorted names = labels 0..K-1), read with
    Pillow; RGB (or grey) uint8, resized to ``size`` (default: the first image's size). ``grey``
    None: one channel when every image is stored with one (greyscale PNG/JPEG), else RGB.

    Every image's pixel count is read from its header and the whole stack is checked against
    the budget before anything is decoded; links out of the tree are refused (``follow_links``)."""
    from PIL import Image, UnidentifiedImageError

    classes = subfolders(path, follow_links)
    if not classes:
        raise DataError(f"{path}: no class sub-folders")
    files = [(label, f) for label, folder in enumerate(classes) for f in regular_files_in(folder, follow_links)
             if f.suffix.lower() in IMAGE_SUFFIXES]
    if size is not None and not (1 <= size[0] <= MAX_IMAGE_SIDE and 1 <= size[1] <= MAX_IMAGE_SIDE):
        raise DataError(f"`image_size` {size[0]}x{size[1]}: each side must be in [1, {MAX_IMAGE_SIDE}]")
    limit = budget.resolve_limit(max_memory)
    pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # the budget below replaces PIL's fixed bomb limit
    try:
        heads = [_image_header(f) for _, f in files]  # headers only: nothing is decoded before the whole stack fits
    finally:
        Image.MAX_IMAGE_PIXELS = pil_limit
    if grey is None:
        grey = bool(heads) and all(mode in GREY_MODES for _, _, mode in heads)
    channels = 1 if grey else 3
    for (_, f), (w, h, _) in zip(files, heads):
        if limit is not None and w * h * 4 * 2 > limit:
            raise ResourceLimitError(f"{f}: declares {w}x{h} pixels, over the memory limit of "
                                     f"{limit / 2**30:.2f} GiB (`max_memory`)")
        if size is None:
            size = (w, h)
    if size is not None:
        budget.require(IMPORT_OVERHEAD * len(files) * size[0] * size[1] * channels, f"importing {path}", max_memory)
    xs, ys = [], []
    for label, f in files:
        try:
            with Image.open(f) as im:
                im = im.convert("L" if grey else "RGB")
                if im.size != size:
                    im = im.resize(size)
                arr = np.asarray(im, dtype=np.uint8)
        except (OSError, ValueError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
            raise DataError(f"{f}: cannot read image ({exc})") from None
        xs.append(arr if grey else arr.transpose(2, 0, 1))
        ys.append(label)
    if not xs:
        raise DataError(f"{path}: no images found")
    return np.stack(xs), np.array(ys, dtype=np.int64)


def from_hdf5(path: Path, x_key: str = "x", y_key: str = "y",
              max_memory: int | str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """A plain HDF5 file with datasets ``x_key`` and (optionally) ``y_key`` (same storage checks as silos)."""
    if not h5py.is_hdf5(path):
        raise DataError(f"{path}: not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            datasets = {}
            for key in (x_key, y_key):
                if key == y_key and key not in f:
                    continue
                problem = plain_dataset_problem(f, key)
                if problem:
                    raise DataError(f"{path} [/{key}]: {problem}")
                ds = f[key]
                if ds.size > MAX_ROWS * 3 * 256 * 256:
                    raise DataError(f"{path} [/{key}]: {ds.shape} exceeds the size cap")
                datasets[key] = ds
            budget.require(IMPORT_OVERHEAD * sum(ds.size * ds.dtype.itemsize for ds in datasets.values()),
                           f"importing {path}", max_memory)
            out = [read_native(datasets[x_key]), read_native(datasets[y_key]) if y_key in datasets else None]
    except OSError as exc:
        raise DataError(f"{path}: cannot read HDF5 ({exc})") from None
    return _inputs(out[0], f"{path} [/{x_key}]"), None if out[1] is None else checked_labels(out[1], f"{path} [/{y_key}]")




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
    raise DataError(f"{source}: cannot tell the format from the name; pass `format` ({', '.join(FORMATS)})")


def is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def load_source(source: str, fmt: str = "auto", labels: str | os.PathLike | None = None, label_column: str = "label",
                x_key: str = "x", y_key: str = "y", size: tuple[int, int] | None = None,
                grey: bool | None = None, max_memory: int | str | None = None,
                follow_links: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Read ``source`` in format ``fmt`` (``auto``: from its name) into ``(x, y)``.

    Only regular files are opened; each importer checks the size its headers declare against
    the memory budget before decompressing or allocating; any parse failure of a hostile file
    is one :class:`DataError` line naming it."""
    fmt = detect_format(source) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "sklearn":
        return from_sklearn(source.split(":", 1)[1] if ":" in source else source)
    p = Path(source)
    if not p.exists():
        raise DataError(f"{p}: not found")
    if not (fmt in ("image-folder", "cifar10") and p.is_dir()):
        require_regular_file(p, f"{fmt} source")
    lab = require_regular_file(labels, "labels") if labels else None
    try:
        if fmt == "npz":
            return from_npz(p, x_key, y_key, max_memory)
        if fmt == "npy":
            return from_npy(p, lab, max_memory)
        if fmt == "csv":
            return from_csv(p, label_column, max_memory)
        if fmt == "image-folder":
            return from_image_folder(p, size, grey, max_memory, follow_links)
        if fmt == "hdf5":
            return from_hdf5(p, x_key, y_key, max_memory)
        if fmt == "cifar10":
            files = [f for f in regular_files_in(p, follow_links) if "_batch" in f.name and f.suffix == ".bin"] \
                if p.is_dir() else [p]
            return from_cifar10_binary(files, max_memory)
        if fmt == "svhn":
            return from_svhn_mat(p, max_memory)
        return from_idx(p, lab, max_memory)
    except (ValueError, OverflowError, IndexError, KeyError, TypeError, EOFError, NotImplementedError,
            UnicodeDecodeError, RecursionError, struct.error, zipfile.BadZipFile, zlib.error) as exc:
        raise DataError(f"{p}: cannot read it as {fmt} ({type(exc).__name__}: {str(exc)[:200]})") from None
    except MemoryError:
        raise ResourceLimitError(f"{p}: ran out of memory while importing it (lower the data size or "
                                 "raise `max_memory`)") from None
