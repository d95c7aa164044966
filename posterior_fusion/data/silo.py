"""Silo / split data files (HDF5): ``/x`` uint8 or float32 inputs, ``/y`` int64 labels
(optional for prediction-only files). Specified in ``docs/data-format.md``.

Root attributes: ``format = "posterior-fusion-data"``, ``format_version = 1``, ``dataset``,
``num_classes``, ``transform`` (the shared input transform, JSON; files without it use the
data set's standard constants for ``fmnist``, else none). Data files come
from strangers as much as artifacts do: :func:`read_silo` validates the header (attribute
types, paths, links, storage inside the file, dtypes, ranks, sizes, memory budget) before
it reads any data, and every failure is one :class:`DataError` line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from posterior_fusion import budget
from posterior_fusion.data.transform import InputTransform
from posterior_fusion.errors import DataError
from posterior_fusion.files import atomic_h5_write, require_regular_file
from posterior_fusion.hdf5_safety import MAX_COMPRESSION_RATIO, plain_dataset_problem, read_native

if TYPE_CHECKING:
    import torch

DATA_FORMAT = "posterior-fusion-data"
DATA_FORMAT_VERSION = 1
MAX_SAMPLES = 10_000_000
MAX_FEATURES = 3 * 512 * 512
MAX_CLASSES = 100_000
MAX_TRANSFORMED = 1e30   # largest |transformed input| accepted (float32 and its squares stay finite)


@dataclass(frozen=True)
class SiloData:
    """One split: ``x`` ``(n, H, W)``, ``(n, C, H, W)`` or ``(n, F)`` uint8/float32, ``y`` ``(n,)``
    int64 (``None`` in a prediction-only file), and the shared input transform."""

    x: np.ndarray
    y: np.ndarray | None
    dataset: str
    num_classes: int
    source: str = ""          # the file it was read from (for error messages)
    transform: InputTransform | None = None
    class_names: tuple[str, ...] = ()  # one name per class where the data has them (string labels, folders)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def input_transform(self) -> InputTransform:
        """The stored transform, else the legacy default (``fmnist`` constants, or identity)."""
        if self.transform is not None:
            return self.transform
        if self.dataset == "fmnist":
            return InputTransform.constants("fmnist", self.x.dtype == np.uint8)
        return InputTransform(1 / 255 if self.x.dtype == np.uint8 else 1.0, (0.0,), (1.0,), "identity")

    def labels(self) -> np.ndarray:
        if self.y is None:
            raise DataError(f"{self.source or 'data'}: has no labels (/y); this needs a labelled file")
        return self.y

    def class_counts(self) -> list[int]:
        return np.bincount(self.labels(), minlength=self.num_classes).astype(int).tolist()

    def inputs(self) -> torch.Tensor:
        """Transformed float32 inputs ``(n, C, H, W)`` or ``(n, F)``."""
        return self.input_transform.apply(self.x, self.source or "data")

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Transformed float32 inputs and int64 labels ``(n,)``."""
        import torch  # here, not at import: reading and describing data files needs no torch

        return self.inputs(), torch.from_numpy(self.labels().astype(np.int64))

    def input_shape(self) -> tuple[int, ...]:
        """Per-sample shape of :meth:`tensors`' inputs (a channel axis is added to ``(H, W)`` images)."""
        shape = tuple(self.x.shape[1:])
        return (1, *shape) if len(shape) == 2 else shape

    def sha256(self) -> str:
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.x).tobytes())
        if self.y is not None:
            h.update(np.ascontiguousarray(self.y).tobytes())
        return h.hexdigest()

    def validate(self, where: str) -> None:
        """The checks :func:`read_silo` makes, for data about to be written: a writer never writes a
        file its own reader refuses (``where`` names the source in the error)."""
        x, y = self.x, self.y
        if x.dtype.name not in ("uint8", "float32") or x.ndim not in (2, 3, 4) or x.shape[0] < 1:
            raise DataError(f"{where}: inputs must be uint8/float32 (n, F), (n, H, W) or (n, C, H, W), got "
                            f"{x.dtype} {x.shape}")
        if x.shape[0] > MAX_SAMPLES or math.prod(x.shape[1:]) > MAX_FEATURES:
            raise DataError(f"{where}: {x.shape} exceeds the size cap ({MAX_SAMPLES} samples of {MAX_FEATURES} values)")
        if not 1 <= self.num_classes <= MAX_CLASSES:
            raise DataError(f"{where}: {self.num_classes} classes, out of range [1, {MAX_CLASSES}]")
        if y is not None:
            if y.ndim != 1 or y.shape[0] != x.shape[0]:
                raise DataError(f"{where}: {x.shape[0]} inputs but labels of shape {y.shape}")
            if y.size and (y.min() < 0 or y.max() >= self.num_classes):
                raise DataError(f"{where}: labels must be in [0, {self.num_classes}), found [{y.min()}, {y.max()}]")
        if self.class_names and (len(self.class_names) != self.num_classes
                                 or not all(isinstance(n, str) and len(n) <= 200 for n in self.class_names)):
            raise DataError(f"{where}: class names must be {self.num_classes} texts of at most 200 characters")
        if x.dtype == np.float32 and not np.isfinite(x).all():
            raise DataError(f"{where}: inputs contain NaN or Inf")
        t = self.input_transform
        channels = 1 if x.ndim == 3 else x.shape[1]
        if len(t.mean) not in (1, channels):
            raise DataError(f"{where}: its input transform has {len(t.mean)} channels, the data {channels}")
        largest = float(x.max()) if x.dtype == np.uint8 else float(np.abs(x).max())  # no copy of uint8 data
        top = (largest * t.scale + max(abs(m) for m in t.mean)) / min(t.std)
        if not top < MAX_TRANSFORMED:
            raise DataError(f"{where}: the input transform (scale {t.scale:g}, std down to {min(t.std):g}) maps the "
                            f"data to values up to {top:.3g}, beyond {MAX_TRANSFORMED:g}; choose another `transform`")

    def subset(self, idx: np.ndarray) -> SiloData:
        return SiloData(self.x[idx], None if self.y is None else self.y[idx], self.dataset, self.num_classes,
                        self.source, self.transform, self.class_names)


def write_silo(path: str | os.PathLike, data: SiloData) -> None:
    """Write ``data`` atomically to ``path`` after :meth:`SiloData.validate`. Data that gzip
    compresses beyond the readers' bomb threshold (all-black images) is stored uncompressed."""
    data.validate(data.source or str(path))

    def fill(f: h5py.File) -> None:
        f.attrs["format"] = DATA_FORMAT
        f.attrs["format_version"] = DATA_FORMAT_VERSION
        f.attrs["dataset"] = data.dataset
        f.attrs["num_classes"] = data.num_classes
        if data.transform is not None:
            f.attrs["transform"] = np.bytes_(data.transform.to_json().encode())
        if data.class_names:
            f.attrs["class_names"] = np.bytes_(json.dumps(list(data.class_names)).encode())
        ds = f.create_dataset("x", data=data.x, compression="gzip", compression_opts=4)
        if ds.id.get_storage_size() * (MAX_COMPRESSION_RATIO // 2) < data.x.nbytes:
            del f["x"]
            f.create_dataset("x", data=data.x)
        if data.y is not None:
            f.create_dataset("y", data=data.y.astype(np.int64))

    atomic_h5_write(path, fill)


def _scalar_attr(f: h5py.File, path: Path, name: str, kind: str, max_len: int = 256):
    """A scalar attribute of kind 'text' or 'int', checked from the header; ``None`` if absent."""
    if name not in f.attrs:
        return None
    aid = h5py.h5a.open(f.id, name.encode())
    if aid.shape not in ((), (1,)):
        raise DataError(f"{path} [/]: attribute {name!r} must be a scalar, not an array of shape {aid.shape}")
    dt = aid.dtype
    if kind == "int":
        if dt.kind not in "iu":
            raise DataError(f"{path} [/]: attribute {name!r} must be an integer")
        return int(np.asarray(f.attrs[name]).reshape(()))
    if not (dt.kind in "SU" or h5py.check_string_dtype(dt) is not None):
        raise DataError(f"{path} [/]: attribute {name!r} must be a string")
    if dt.itemsize > max(4096, max_len):
        raise DataError(f"{path} [/]: attribute {name!r} is too long")
    value = f.attrs[name]
    value = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(np.asarray(value).reshape(()))
    if len(value) > max_len:
        raise DataError(f"{path} [/]: attribute {name!r} is too long")
    return value


def _dataset(f: h5py.File, path: Path, key: str) -> h5py.Dataset:
    problem = plain_dataset_problem(f, key)
    if problem:
        raise DataError(f"{path} [/{key}]: {problem}")
    return f[key]


@dataclass(frozen=True)
class SiloHeader:
    """What a data file declares, validated before any data is read."""

    n: int
    x_shape: tuple[int, ...]
    x_dtype: str
    dataset: str
    num_classes: int
    has_labels: bool = True
    transform: InputTransform | None = None
    class_names: tuple[str, ...] = ()

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample shape of the model inputs (a channel axis added to ``(H, W)`` images)."""
        shape = tuple(self.x_shape[1:])
        return (1, *shape) if len(shape) == 2 else shape

    @property
    def load_bytes(self) -> int:
        """Bytes allocated by loading and converting to float32 tensors (4 bytes per value + labels)."""
        return int(np.prod(self.x_shape)) * (4 + np.dtype(self.x_dtype).itemsize) + self.n * 16


def _header(f: h5py.File, path: Path) -> SiloHeader:
    if _scalar_attr(f, path, "format", "text") != DATA_FORMAT:
        raise DataError(f"{path}: not a posterior-fusion data file (missing format attribute)")
    version = _scalar_attr(f, path, "format_version", "int")
    if version != DATA_FORMAT_VERSION:
        raise DataError(f"{path}: unsupported data format_version {version}")
    extra = sorted(set(f.keys()) - {"x", "y"})
    if extra:
        raise DataError(f"{path} [/{extra[0]}]: object not allowed in a data file (only /x and /y)")
    xd = _dataset(f, path, "x")
    if xd.dtype.name not in ("uint8", "float32") or xd.ndim not in (2, 3, 4):
        raise DataError(f"{path} [/x]: expected uint8/float32 of rank 2-4, got {xd.dtype} {xd.shape}")
    has_labels = "y" in f or f.get("y", getlink=True) is not None
    if has_labels:
        yd = _dataset(f, path, "y")
        if yd.dtype.kind != "i" or yd.dtype.itemsize != 8 or yd.ndim != 1 or yd.shape[0] != xd.shape[0]:
            raise DataError(f"{path} [/y]: expected int64 (n,) matching /x, got {yd.dtype} {yd.shape}")
    n = xd.shape[0]
    if n < 1:
        raise DataError(f"{path} [/x]: the data file is empty")
    if n > MAX_SAMPLES or int(np.prod(xd.shape[1:])) > MAX_FEATURES:
        raise DataError(f"{path} [/x]: {xd.shape} exceeds the size cap ({MAX_SAMPLES} samples of {MAX_FEATURES} values)")
    dataset = _scalar_attr(f, path, "dataset", "text") or "unknown"
    k = _scalar_attr(f, path, "num_classes", "int")
    if k is not None and not 1 <= k <= MAX_CLASSES:
        raise DataError(f"{path} [/]: num_classes {k} out of range [1, {MAX_CLASSES}]")
    text = _scalar_attr(f, path, "transform", "text", 4_000_000) if "transform" in f.attrs else None
    transform = InputTransform.from_json(text, f"{path} [/]") if text else None
    names: tuple[str, ...] = ()
    if "class_names" in f.attrs:
        raw = _scalar_attr(f, path, "class_names", "text", 4_000_000)
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            parsed = None
        if (not isinstance(parsed, list) or len(parsed) != (k or 0)
                or not all(isinstance(v, str) and len(v) <= 200 for v in parsed)):
            raise DataError(f"{path} [/]: attribute 'class_names' must list {k or 0} texts of at most 200 characters")
        names = tuple(parsed)
    return SiloHeader(n, tuple(xd.shape), xd.dtype.name, dataset, k or 0, has_labels, transform, names)


@contextmanager
def _open_data(path: Path) -> Iterator[tuple[h5py.File, SiloHeader]]:
    """Open a data file and validate its header; every h5py/OS failure becomes one DataError."""
    require_regular_file(path, "data file")
    if not h5py.is_hdf5(path):
        raise DataError(f"{path}: not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            yield f, _header(f, path)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a readable HDF5 data file ({type(exc).__name__}: {exc})") from None


def read_silo(path: str | os.PathLike, num_classes: int | None = None,
              max_memory: int | str | None = None, labels: bool = True) -> SiloData:
    """Read and validate a data file; labels must lie in ``[0, num_classes)``. With
    ``labels=False`` a file without ``/y`` is accepted (prediction only)."""
    path = Path(path)
    with _open_data(path) as (f, head):
        budget.require(head.load_bytes, f"reading {path}", max_memory)
        if labels and not head.has_labels:
            raise DataError(f"{path}: missing dataset /y (labels are needed here)")
        x = read_native(f["x"])
        y = read_native(f["y"]) if head.has_labels else None
    k = num_classes if num_classes is not None else head.num_classes
    if k < 1:
        raise DataError(f"{path}: num_classes missing or invalid")
    if y is not None and (y.min() < 0 or y.max() >= k):
        raise DataError(f"{path} [/y]: labels must be in [0, {k}), found range [{y.min()}, {y.max()}]")
    names = head.class_names if len(head.class_names) == k else ()
    out = SiloData(x, None if y is None else y.astype(np.int64), head.dataset, k, str(path), head.transform, names)
    out.validate(f"{path} [/x]")
    return out


def read_data(path: str | os.PathLike, max_memory: int | str | None = None) -> SiloData:
    """A data file (from ``import-data`` or ``partition``) for a notebook, validated like every data file.

    Args:
        path: the data file.
        max_memory: the memory limit, bytes or a size such as ``"8G"`` [default: 80% of available memory].

    Returns:
        A ``SiloData``: ``.x`` the stored inputs ``(n, …)``, ``.y`` the labels ``(n,)`` (None in a prediction-only
        file), ``.input_transform`` the shared transform and ``.inputs()`` the transformed float32 model inputs.
    """
    return read_silo(path, max_memory=max_memory, labels=False)


def is_data_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular HDF5 file whose ``format`` attribute names a data file (a quick
    look at the root attribute; the file is validated when it is read)."""
    p = Path(path)
    try:
        if not p.is_file() or not h5py.is_hdf5(p):
            return False
        with h5py.File(p, "r") as f:
            value = f.attrs.get("format")
    except (OSError, ValueError, RuntimeError, KeyError, TypeError):
        return False
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return value == DATA_FORMAT


def describe_data(path: str | os.PathLike, max_memory: int | str | None = None) -> dict:
    """A data file's summary for ``pfuse inspect``: size, input shape and dtype, classes and their
    counts, the input transform (the whole file is read and validated)."""
    head = silo_header(path)
    data = read_silo(path, max_memory=max_memory, labels=False)
    return {"file": str(path), "kind": "data", "n": head.n, "input_shape": list(head.input_shape),
            "stored_dtype": head.x_dtype, "dataset": head.dataset, "num_classes": head.num_classes,
            "labelled": head.has_labels, "class_counts": data.class_counts() if data.y is not None else None,
            "input_transform": data.input_transform.to_dict(), "class_names": list(data.class_names) or None}


def silo_header(path: str | os.PathLike) -> SiloHeader:
    """Validate a data file's header only (no data read); used for memory estimates."""
    with _open_data(Path(path)) as (_, head):
        return head
