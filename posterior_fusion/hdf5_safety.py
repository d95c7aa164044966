"""The HDF5 safety checks shared by artifacts, data files and imported HDF5 sources: where a
dataset's bytes come from, checked before they are read (untrusted files).

HDF5 lets a dataset's bytes live outside the file: *external raw storage* (a list of other
files, possibly FIFOs or devices) and *virtual datasets* (views of datasets in other HDF5
files). A hostile file uses them to make a reader read, and then republish, files of the
machine it runs on. A file can also declare a huge dataset whose chunks were never written
(reads return fill values: a tiny file, a huge allocation), or a compression bomb. This
module refuses all of these from the dataset's creation properties and allocated size.
"""

from __future__ import annotations

import h5py
import numpy as np

# Filters a posterior-fusion file may use: deflate (gzip), shuffle and fletcher32 checksums.
ALLOWED_FILTERS = {h5py.h5z.FILTER_DEFLATE: "gzip", h5py.h5z.FILTER_SHUFFLE: "shuffle",
                   h5py.h5z.FILTER_FLETCHER32: "fletcher32"}
MAX_COMPRESSION_RATIO = 200


def storage_problem(ds: h5py.Dataset) -> str | None:
    """Why ``ds``'s bytes may not be read, or ``None`` when they are all allocated inside the file."""
    dcpl = ds.id.get_create_plist()
    layout = dcpl.get_layout()
    if layout == h5py.h5d.VIRTUAL or ds.is_virtual:
        return "virtual dataset (data from other files) not allowed"
    if dcpl.get_external_count() > 0:
        return "external raw storage (data from other files) not allowed"
    if layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED, h5py.h5d.COMPACT):
        return "unsupported storage layout"
    filters = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
    bad = [f for f in filters if f not in ALLOWED_FILTERS]
    if bad:
        return f"HDF5 filter {bad[0]} not allowed (only {', '.join(ALLOWED_FILTERS.values())})"
    if ds.dtype.kind not in "biuf" or ds.dtype.hasobject:
        return f"dtype {ds.dtype} not allowed"
    declared = int(ds.size) * ds.dtype.itemsize
    if declared == 0:
        return None
    allocated = ds.id.get_storage_size()
    compressed = any(f == h5py.h5z.FILTER_DEFLATE for f in filters)
    if not compressed and allocated < declared:
        return f"only {allocated} of {declared} declared bytes are stored in the file (unallocated data)"
    if compressed and allocated * MAX_COMPRESSION_RATIO < declared:
        return (f"declares {declared} bytes stored in {allocated} (compression ratio over "
                f"{MAX_COMPRESSION_RATIO}: unallocated chunks or a compression bomb)")
    return None


def read_native(ds: h5py.Dataset) -> np.ndarray:
    """Read ``ds`` (after :func:`storage_problem` passed) as a native-byte-order array."""
    arr = ds[()]
    if isinstance(arr, np.ndarray) and not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def plain_dataset_problem(f: h5py.File, key: str) -> str | None:
    """Why ``f[key]`` is not a plain, hard-linked dataset whose bytes are all inside the file
    (``None`` when it is): soft and external links, groups and :func:`storage_problem` refused."""
    link = f.get(key, getlink=True)
    if link is None:
        return "missing dataset"
    if not isinstance(link, h5py.HardLink):
        return f"{type(link).__name__} not allowed (only plain datasets)"
    obj = f[key]
    if not isinstance(obj, h5py.Dataset):
        return f"is a {type(obj).__name__}, expected a dataset"
    return storage_problem(obj)
