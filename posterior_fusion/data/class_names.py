"""The names of the classes behind a data source's labels, where the source has them (``pfuse import-data``
writes them into the data file; ``predict`` writes them beside each row)."""

from __future__ import annotations

import csv
import zipfile
from pathlib import Path

import numpy as np

from posterior_fusion.data.importers import detect_format, is_int
from posterior_fusion.files import subfolders

MAX_CLASS_NAME = 200  # characters of one class name kept


def source_class_names(source: str, fmt: str = "auto", label_column: str = "label", follow_links: bool = False,
                       **_: object) -> tuple[str, ...]:
    """The class names behind the labels :func:`load_source` returns, index by index, where the source
    has them: a CSV whose label column holds names (sorted, as the labels), an image folder's class
    sub-folders; ``()`` otherwise (the labels are the classes' own numbers)."""
    fmt = detect_format(source) if fmt == "auto" else fmt
    p = Path(source)
    if fmt == "image-folder" and p.is_dir():
        return tuple(folder.name[:MAX_CLASS_NAME] for folder in subfolders(p, follow_links))
    if fmt == "sklearn":
        return sklearn_class_names(source.split(":", 1)[1])
    if fmt == "npz":
        return npz_class_names(p)
    if fmt != "csv":
        return ()
    try:
        with open(p, newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader)
            if label_column not in header:
                return ()
            li = header.index(label_column)
            raw = {row[li] for row in reader if len(row) > li}
    except (OSError, UnicodeDecodeError, csv.Error, StopIteration):
        return ()
    if all(is_int(v) for v in raw):
        return ()
    return tuple(name[:MAX_CLASS_NAME] for name in sorted(raw))


def sklearn_class_names(name: str) -> tuple[str, ...]:
    """A scikit-learn set's ``target_names`` (``digits``: the digits themselves), or ``()``."""
    try:
        from sklearn import datasets
    except ImportError:
        return ()
    loader = {"digits": datasets.load_digits, "breast_cancer": datasets.load_breast_cancer,
              "wine": datasets.load_wine}.get(name)
    return tuple(str(t)[:MAX_CLASS_NAME] for t in loader().target_names) if loader else ()


def npz_class_names(path: Path) -> tuple[str, ...]:
    """An npz's optional ``class_names`` member: a 1-D array of strings (label k's name at k), read only when its
    stored size is at most 16 MiB; ``()`` where there is none or it is not that."""
    try:
        with zipfile.ZipFile(path) as z:
            info = next((i for i in z.infolist() if i.filename == "class_names.npy"), None)
            if info is None or info.file_size > 16 * 2**20:
                return ()
            with z.open(info) as fh:
                names = np.lib.format.read_array(fh, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return ()
    if names.ndim != 1 or names.dtype.kind not in "US":
        return ()
    return tuple((n.decode(errors="replace") if isinstance(n, bytes) else str(n))[:MAX_CLASS_NAME] for n in names)


