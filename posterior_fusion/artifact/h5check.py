"""Opening an artifact and checking its HDF5 objects, torch-free (shared by the reader and the
header preview of ``pfuse inspect``). Every error names the file."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from posterior_fusion.artifact import schema
from posterior_fusion.artifact.jsonattr import HeaderProblem, parse_json
from posterior_fusion.errors import (
    ArtifactError,
    ArtifactNotFoundError,
    NotAnArtifactError,
    SchemaError,
    ValueCheckError,
)
from posterior_fusion.hdf5_safety import storage_problem


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of the file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def open_file_sha256(f: h5py.File) -> str:
    """SHA-256 (hex) of the bytes of the file ``f`` has open, read through HDF5's own descriptor:
    the hash is of the file that was validated, not of whatever the path names a moment later."""
    fd = f.id.get_vfd_handle()
    h = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


class Checker:
    """Holds the file name so every error names it."""

    def __init__(self, path: Path) -> None:
        self.file = str(path)
        self.text_bytes = 0  # text attributes read so far (a file of many links to one big attribute is refused)

    def bad_schema(self, where: str, msg: str) -> SchemaError:
        return SchemaError(self.file, msg, where)

    def bad_value(self, where: str, msg: str) -> ValueCheckError:
        return ValueCheckError(self.file, msg, where)

    def attr(self, obj: h5py.HLObject, name: str, where: str, kind: str) -> Any:
        """Read attribute ``name`` after checking its type and size ('text' or 'int') from the header."""
        if name not in obj.attrs:
            raise self.bad_schema(where, f"missing attribute {name!r}")
        aid = h5py.h5a.open(obj.id, name.encode())
        dtype, shape = aid.dtype, aid.shape
        if kind == "int":
            if dtype.kind not in "iu" or shape not in ((), (1,)):
                raise self.bad_schema(where, f"attribute {name!r} must be a scalar integer")
            return int(np.asarray(obj.attrs[name]).reshape(()))
        if dtype.kind != "S" or shape != ():
            raise self.bad_schema(where, f"attribute {name!r} must be a fixed-length UTF-8 string")
        if dtype.itemsize > schema.MAX_JSON_CHARS:
            raise self.bad_schema(where, f"attribute {name!r} is larger than {schema.MAX_JSON_CHARS} bytes")
        self.text_bytes += dtype.itemsize
        if self.text_bytes > schema.MAX_TEXT_BYTES:
            raise self.bad_schema(where, f"the file's text attributes exceed {schema.MAX_TEXT_BYTES} bytes in all")
        try:
            return bytes(obj.attrs[name]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad_schema(where, f"attribute {name!r} is not valid UTF-8") from None

    def walk(self, f: h5py.File, pattern: re.Pattern) -> set[str]:
        """All object paths in the file; refuses soft and external links, paths ``pattern`` does not match,
        objects other than groups and datasets, and more objects than a schema-sized file holds."""
        found: set[str] = set()
        stack = ["/"]
        while stack:
            gpath = stack.pop()
            group = f[gpath]
            for key in group.keys():
                full = (gpath.rstrip("/") + "/" + key)
                link = group.get(key, getlink=True)
                if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
                    raise self.bad_schema(full, f"{type(link).__name__} not allowed (only plain groups and datasets)")
                if not pattern.match(full):
                    raise self.bad_schema(full, "path not allowed by the schema")
                if len(found) > 4 * schema.MAX_BLOCKS * 4:
                    raise self.bad_schema(full, "too many objects in the file")
                found.add(full)
                obj = group.get(key)
                if isinstance(obj, h5py.Group):
                    stack.append(full)
                elif not isinstance(obj, h5py.Dataset):
                    raise self.bad_schema(full, "unsupported HDF5 object type")
        return found

    def root_attributes(self, f: h5py.File) -> None:
        """Refuses root attributes the schema does not name."""
        extra = set(f.attrs.keys()) - schema.ROOT_ATTRS
        if extra:
            raise self.bad_schema("/", f"unexpected root attributes: {', '.join(sorted(extra))[:200]}")

    def json_attr(self, obj: h5py.HLObject, name: str, where: str) -> Any:
        return parse_json(self.attr(obj, name, where, "text"), where, name)

    def dataset(self, f: h5py.File, where: str, shape: tuple[int, ...], dtypes=schema.FLOAT_DTYPES) -> h5py.Dataset:
        obj = f.get(where)
        if not isinstance(obj, h5py.Dataset):
            raise self.bad_schema(where, "missing dataset")
        if obj.dtype.kind not in "fiu" or obj.dtype.name not in dtypes:
            raise self.bad_schema(where, f"dtype {obj.dtype} not allowed (expected one of {', '.join(dtypes)})")
        if tuple(obj.shape) != tuple(shape):
            raise self.bad_schema(where, f"shape {tuple(obj.shape)} does not match the expected {tuple(shape)}")
        problem = storage_problem(obj)
        if problem:
            raise self.bad_schema(where, problem)
        return obj


@contextmanager
def open_artifact(path: Path) -> Iterator[tuple[Checker, h5py.File]]:
    """Open ``path`` read-only; any h5py/OS failure inside becomes a NotAnArtifactError."""
    chk = Checker(path)
    if not path.is_file():
        raise ArtifactNotFoundError(str(path), "file not found")
    if not h5py.is_hdf5(path):
        raise NotAnArtifactError(str(path), "not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            yield chk, f
    except ArtifactError:
        raise
    except HeaderProblem as exc:
        raise SchemaError(str(path), exc.message, exc.where) from None
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise NotAnArtifactError(str(path), f"corrupt or truncated HDF5 file ({type(exc).__name__}: {exc})") from None


