"""Validating reader for artifacts (untrusted input).

Two phases, in this order:
1. **Header** (nothing but attributes and dataset metadata is read): the file opens as
   HDF5, the format name and version are known, JSON attributes parse within size caps,
   the model spec is registered and matches the layout, every object in the file is on the
   whitelist, is a hard link, has an allowed dtype and the shape its metadata implies, and
   the curvature blocks tile the parameter vector.
2. **Values**: data is read only after phase 1 passed; it must be finite, diagonal
   curvature >= 0, factors symmetric with a non-negative diagonal.

Every failure raises a subclass of :class:`~posterior_fusion.errors.ArtifactError`
naming the file and the HDF5 path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from posterior_fusion.artifact import schema
from posterior_fusion.artifact.objects import (
    ClientPosterior,
    Component,
    GlobalEnsemble,
    SwagMoments,
    frozen_mapping,
)
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron, Precision
from posterior_fusion.errors import (
    ArtifactError,
    ArtifactNotFoundError,
    ModelSpecError,
    NotAnArtifactError,
    SchemaError,
    UnsupportedVersionError,
    ValueCheckError,
)
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec

SYMMETRY_RTOL = 1e-4
REQUIRED_CLIENT_META = {"n_data": int, "class_counts": list, "temperature": (int, float),
                        "prior_precision": (int, float), "structure": str, "num_components": int}


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Checker:
    """Holds the file name so every error names it."""

    def __init__(self, path: Path) -> None:
        self.file = str(path)

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
        try:
            return bytes(obj.attrs[name]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad_schema(where, f"attribute {name!r} is not valid UTF-8") from None

    def json_attr(self, obj: h5py.HLObject, name: str, where: str) -> Any:
        raw = self.attr(obj, name, where, "text")
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise self.bad_schema(where, f"attribute {name!r} is not valid JSON ({exc.msg})") from None

    def dataset(self, f: h5py.File, where: str, shape: tuple[int, ...], dtypes=schema.FLOAT_DTYPES) -> h5py.Dataset:
        obj = f.get(where)
        if not isinstance(obj, h5py.Dataset):
            raise self.bad_schema(where, "missing dataset")
        if obj.dtype.kind not in "fiu" or obj.dtype.name not in dtypes:
            raise self.bad_schema(where, f"dtype {obj.dtype} not allowed (expected one of {', '.join(dtypes)})")
        if tuple(obj.shape) != tuple(shape):
            raise self.bad_schema(where, f"shape {tuple(obj.shape)} does not match the expected {tuple(shape)}")
        return obj


def _walk(chk: _Checker, f: h5py.File, pattern) -> set[str]:
    """All object paths in the file; rejects soft/external links and non-whitelisted paths."""
    found: set[str] = set()
    stack = ["/"]
    while stack:
        gpath = stack.pop()
        group = f[gpath]
        for key in group.keys():
            full = (gpath.rstrip("/") + "/" + key)
            link = group.get(key, getlink=True)
            if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
                raise chk.bad_schema(full, f"{type(link).__name__} not allowed (only plain groups and datasets)")
            if not pattern.match(full):
                raise chk.bad_schema(full, "path not allowed by the schema")
            if len(found) > 4 * schema.MAX_BLOCKS * 4:
                raise chk.bad_schema(full, "too many objects in the file")
            found.add(full)
            obj = group.get(key)
            if isinstance(obj, h5py.Group):
                stack.append(full)
            elif not isinstance(obj, h5py.Dataset):
                raise chk.bad_schema(full, "unsupported HDF5 object type")
    return found


def _parse_layout(chk: _Checker, raw: Any) -> ParameterLayout:
    if not isinstance(raw, list) or not 1 <= len(raw) <= schema.MAX_LAYOUT_ENTRIES:
        raise chk.bad_schema("/", "layout must be a non-empty JSON list")
    named: list[tuple[str, tuple[int, ...]]] = []
    total = 0
    for i, e in enumerate(raw):
        ok = (isinstance(e, dict) and set(e) == {"name", "shape"} and isinstance(e["name"], str)
              and isinstance(e["shape"], list) and 1 <= len(e["shape"]) <= 5
              and all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= schema.MAX_PARAMS for s in e["shape"]))
        if not ok:
            raise chk.bad_schema("/", f"layout entry {i} must be {{'name': str, 'shape': [positive ints]}}")
        total += math.prod(e["shape"])
        if total > schema.MAX_PARAMS:
            raise chk.bad_schema("/", f"layout declares more than {schema.MAX_PARAMS} parameters")
        named.append((e["name"], tuple(e["shape"])))
    return ParameterLayout.from_shapes(named)


def _header(chk: _Checker, f: h5py.File) -> tuple[str, ModelSpec, ParameterLayout, dict]:
    for name in ("format", "format_version", "artifact_kind"):
        if name not in f.attrs:
            raise NotAnArtifactError(chk.file, f"missing root attribute {name!r}: not a posterior-fusion artifact", "/")
    fmt = chk.attr(f, "format", "/", "text")
    if fmt != schema.FORMAT_NAME:
        raise NotAnArtifactError(chk.file, f"format is {fmt[:100]!r}, expected {schema.FORMAT_NAME!r}", "/")
    try:
        version = chk.attr(f, "format_version", "/", "int")
    except SchemaError:
        raise UnsupportedVersionError(chk.file, "format_version is not an integer", "/") from None
    if version != schema.FORMAT_VERSION:
        raise UnsupportedVersionError(chk.file, f"format_version {version} is not supported (this reader knows {schema.FORMAT_VERSION})", "/")
    extra = set(f.attrs.keys()) - schema.ROOT_ATTRS
    if extra:
        raise chk.bad_schema("/", f"unexpected root attributes: {', '.join(sorted(extra))[:200]}")
    kind = chk.attr(f, "artifact_kind", "/", "text")
    if kind not in (schema.KIND_CLIENT, schema.KIND_GLOBAL):
        raise chk.bad_schema("/", f"artifact_kind {kind[:100]!r} must be 'client' or 'global'")
    spec_raw = chk.json_attr(f, "model_spec", "/")
    try:
        spec = ModelSpec.from_json(json.dumps(spec_raw))
    except ModelSpecError as exc:
        raise chk.bad_schema("/", f"model_spec: {exc}") from None
    layout = _parse_layout(chk, chk.json_attr(f, "layout", "/"))
    with torch.device("meta"):  # shapes only: a hostile spec allocates nothing
        expected = ParameterLayout.from_model(spec.build())
    if [(e.name, e.shape) for e in expected.entries] != [(e.name, e.shape) for e in layout.entries]:
        raise chk.bad_schema("/", f"layout does not match the parameters of model {spec.name!r} {spec.kwargs}")
    meta = chk.json_attr(f, "metadata", "/")
    if not isinstance(meta, dict):
        raise chk.bad_schema("/", "metadata must be a JSON object")
    return str(kind), spec, layout, meta


def _check_blocks(chk: _Checker, where: str, descr: Any, layout: ParameterLayout) -> list[dict]:
    if not isinstance(descr, list) or not 1 <= len(descr) <= schema.MAX_BLOCKS:
        raise chk.bad_schema(where, "attribute 'blocks' must be a non-empty JSON list")
    offset = 0
    starts = {e.offset: e for e in layout.entries}
    for i, b in enumerate(descr):
        if not isinstance(b, dict) or b.get("kind") not in schema.BLOCK_KINDS:
            raise chk.bad_schema(f"{where}/{i}", f"block kind must be one of {schema.BLOCK_KINDS}")
        size, off = b.get("size"), b.get("offset")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, off)) or size < 1:
            raise chk.bad_schema(f"{where}/{i}", "block offset/size must be integers, size >= 1")
        if off != offset:
            raise chk.bad_schema(f"{where}/{i}", f"blocks do not tile the parameters: offset {off}, expected {offset}")
        if b["kind"] == "dense" and size > schema.MAX_DENSE_SIDE:
            raise chk.bad_schema(f"{where}/{i}", f"dense block of side {size} exceeds the cap {schema.MAX_DENSE_SIDE}")
        if b["kind"] == "kron":
            shape = b.get("shape")
            entry = starts.get(off)
            if (not isinstance(shape, list) or len(shape) != 2
                    or not all(isinstance(s, int) and 1 <= s <= schema.MAX_DENSE_SIDE for s in shape)
                    or shape[0] * shape[1] != size):
                raise chk.bad_schema(f"{where}/{i}", "kron block needs shape [out, in] with out*in == size")
            if entry is None or entry.matrix_shape != tuple(shape):
                raise chk.bad_schema(f"{where}/{i}", f"kron block {shape} at offset {off} is not a weight of the layout")
        offset += size
    if offset != layout.dim:
        raise chk.bad_schema(where, f"blocks cover {offset} parameters, the layout has {layout.dim}")
    return descr


def _block_datasets(b: dict) -> dict[str, tuple[int, ...]]:
    if b["kind"] == "diag":
        return {"diag": (b["size"],)}
    if b["kind"] == "dense":
        return {"dense": (b["size"], b["size"])}
    out, inn = b["shape"]
    return {"kron_B": (out, out), "kron_A": (inn, inn)}


def _read(chk: _Checker, ds: h5py.Dataset, where: str) -> torch.Tensor:
    try:
        arr = ds[()]
    except (OSError, ValueError, RuntimeError) as exc:
        raise NotAnArtifactError(chk.file, f"cannot read data (truncated or corrupt file?): {exc}", where) from None
    if not np.isfinite(arr).all():
        raise chk.bad_value(where, "contains NaN or Inf")
    return torch.from_numpy(np.ascontiguousarray(arr))


def _check_factor(chk: _Checker, t: torch.Tensor, where: str) -> None:
    if (torch.diagonal(t) < 0).any():
        raise chk.bad_value(where, "curvature factor has a negative diagonal entry")
    scale = t.abs().max().item()
    if scale > 0 and (t - t.T).abs().max().item() > SYMMETRY_RTOL * scale:
        raise chk.bad_value(where, "curvature factor is not symmetric")


def _client_plan(chk: _Checker, f: h5py.File, layout: ParameterLayout, meta: dict) -> list[tuple]:
    """Phase 1 for a client artifact: metadata, paths, dtypes and shapes; reads no data."""
    for key, typ in REQUIRED_CLIENT_META.items():
        if key not in meta or not isinstance(meta[key], typ) or isinstance(meta[key], bool):
            raise chk.bad_schema("/", f"metadata field {key!r} missing or not {typ}")
    if meta["structure"] not in schema.STRUCTURES:
        raise chk.bad_schema("/", f"structure {meta['structure']!r} must be one of {schema.STRUCTURES}")
    if not (meta["temperature"] > 0 and meta["prior_precision"] > 0 and meta["n_data"] >= 1):
        raise chk.bad_schema("/", "metadata needs temperature > 0, prior_precision > 0, n_data >= 1")
    m = meta["num_components"]
    if not 1 <= m <= schema.MAX_COMPONENTS:
        raise chk.bad_schema("/", f"num_components {m} out of range [1, {schema.MAX_COMPONENTS}]")
    paths = _walk(chk, f, schema.CLIENT_PATH_RE)
    d = layout.dim
    plan = []  # (index, blocks, has_swag, swag_rank)
    for i in range(m):
        base = f"/components/{i}"
        if base not in paths:
            raise chk.bad_schema(base, "missing component group")
        chk.dataset(f, f"{base}/map", (d,))
        training = chk.json_attr(f[base], "training", base)
        if not isinstance(training, dict):
            raise chk.bad_schema(base, "attribute 'training' must be a JSON object")
        if f"{base}/curvature" not in paths:
            raise chk.bad_schema(f"{base}/curvature", "missing curvature group")
        blocks = _check_blocks(chk, f"{base}/curvature", chk.json_attr(f[f"{base}/curvature"], "blocks", f"{base}/curvature"), layout)
        for j, b in enumerate(blocks):
            for name, shape in _block_datasets(b).items():
                chk.dataset(f, f"{base}/curvature/{j}/{name}", shape)
        rank = None
        if f"{base}/swag" in paths:
            dev = f.get(f"{base}/swag/deviations")
            if not isinstance(dev, h5py.Dataset) or dev.ndim != 2 or not 1 <= dev.shape[0] <= schema.MAX_SWAG_RANK:
                raise chk.bad_schema(f"{base}/swag/deviations", f"must be (K, d) with 1 <= K <= {schema.MAX_SWAG_RANK}")
            rank = dev.shape[0]
            for name, shape in (("mean", (d,)), ("sq_mean", (d,)), ("deviations", (rank, d))):
                chk.dataset(f, f"{base}/swag/{name}", shape)
        plan.append((i, training, blocks, rank))
    expected_groups = {f"/components/{i}" for i in range(m)}
    extra = {p for p in paths if p.count("/") == 2} - expected_groups
    if extra:
        raise chk.bad_schema(sorted(extra)[0], f"component not declared by num_components={m}")
    expected_blocks = {f"/components/{i}/curvature/{j}" for i, _, blocks, _ in plan for j in range(len(blocks))}
    expected_blocks |= {f"{p}/{n}" for i, _, blocks, _ in plan for j, b in enumerate(blocks)
                        for p in [f"/components/{i}/curvature/{j}"] for n in _block_datasets(b)}
    extra = {p for p in paths if "/curvature/" in p} - expected_blocks
    if extra:
        raise chk.bad_schema(sorted(extra)[0], "object not declared by the curvature 'blocks' attribute")

    return plan


def _client(chk: _Checker, f: h5py.File, layout: ParameterLayout, meta: dict, plan: list[tuple]) -> list[Component]:
    """Phase 2 for a client artifact: read and check values."""
    comps = []
    for i, training, blocks, rank in plan:
        base = f"/components/{i}"
        w = _read(chk, f[f"{base}/map"], f"{base}/map")
        parts: list[Precision] = []
        for j, b in enumerate(blocks):
            where = f"{base}/curvature/{j}"
            if b["kind"] == "diag":
                g = _read(chk, f[f"{where}/diag"], f"{where}/diag")
                if (g < 0).any():
                    raise chk.bad_value(f"{where}/diag", "diagonal curvature has negative entries")
                parts.append(Diag(g))
            elif b["kind"] == "dense":
                G = _read(chk, f[f"{where}/dense"], f"{where}/dense")
                _check_factor(chk, G, f"{where}/dense")
                parts.append(Dense(G))
            else:
                B = _read(chk, f[f"{where}/kron_B"], f"{where}/kron_B")
                A = _read(chk, f[f"{where}/kron_A"], f"{where}/kron_A")
                _check_factor(chk, B, f"{where}/kron_B")
                _check_factor(chk, A, f"{where}/kron_A")
                parts.append(Kron(B, A))
        swag = None
        if rank is not None:
            swag = SwagMoments(*(_read(chk, f[f"{base}/swag/{n}"], f"{base}/swag/{n}")
                                 for n in ("mean", "sq_mean", "deviations")))
        comps.append(Component(i, w, BlockDiag(parts), frozen_mapping(training),
                               float(meta["temperature"]), float(meta["prior_precision"]), swag))
    return comps


def _global(chk: _Checker, f: h5py.File, layout: ParameterLayout, meta: dict) -> list[torch.Tensor]:
    n = meta.get("num_members")
    if not isinstance(n, int) or not 1 <= n <= schema.MAX_MEMBERS:
        raise chk.bad_schema("/", f"metadata num_members must be an integer in [1, {schema.MAX_MEMBERS}]")
    paths = _walk(chk, f, schema.GLOBAL_PATH_RE)
    expected = {"/members"} | {f"/members/{i}" for i in range(n)} | {f"/members/{i}/weights" for i in range(n)}
    if paths != expected:
        bad = sorted(paths ^ expected)[0]
        raise chk.bad_schema(bad, "members do not match metadata num_members")
    for i in range(n):
        chk.dataset(f, f"/members/{i}/weights", (layout.dim,))
    return [_read(chk, f[f"/members/{i}/weights"], f"/members/{i}/weights") for i in range(n)]


@contextmanager
def _open(path: Path) -> Iterator[tuple[_Checker, h5py.File]]:
    """Open ``path`` read-only; any h5py/OS failure inside becomes a NotAnArtifactError."""
    chk = _Checker(path)
    if not path.is_file():
        raise ArtifactNotFoundError(str(path), "file not found")
    if not h5py.is_hdf5(path):
        raise NotAnArtifactError(str(path), "not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            yield chk, f
    except ArtifactError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise NotAnArtifactError(str(path), f"corrupt or truncated HDF5 file ({type(exc).__name__}: {exc})") from None


def declared_bytes(path: str | os.PathLike) -> dict[str, Any]:
    """Validate an artifact's header (phase 1 only) and report its size without reading data.

    Returns ``{"kind", "num_params", "num_components", "data_bytes"}``, where ``data_bytes``
    is the in-memory size of every dataset once loaded.
    """
    with _open(Path(path)) as (chk, f):
        kind, _, layout, meta = _header(chk, f)
        if kind == schema.KIND_CLIENT:
            _client_plan(chk, f, layout, meta)
        pattern = schema.CLIENT_PATH_RE if kind == schema.KIND_CLIENT else schema.GLOBAL_PATH_RE
        total = sum(f[p].size * f[p].dtype.itemsize for p in _walk(chk, f, pattern) if isinstance(f[p], h5py.Dataset))
    return {"kind": kind, "num_params": layout.dim, "num_components": meta.get("num_components", meta.get("num_members")),
            "data_bytes": total}


def load(path: str | os.PathLike) -> ClientPosterior | GlobalEnsemble:
    """Validate and load an artifact; returns :class:`ClientPosterior` or :class:`GlobalEnsemble`.

    Raises a subclass of :class:`~posterior_fusion.errors.ArtifactError` on any problem.
    """
    path = Path(path)
    with _open(path) as (chk, f):
        kind, spec, layout, meta = _header(chk, f)
        if kind == schema.KIND_CLIENT:
            comps = _client(chk, f, layout, meta, _client_plan(chk, f, layout, meta))
        else:
            members = _global(chk, f, layout, meta)
    sha = file_sha256(path)
    if kind == schema.KIND_CLIENT:
        return ClientPosterior(str(path), sha, spec, layout, frozen_mapping(meta), tuple(comps))
    return GlobalEnsemble(str(path), sha, spec, layout, frozen_mapping(meta), tuple(members))


def load_client(path: str | os.PathLike) -> ClientPosterior:
    """:func:`load`, insisting on a client artifact."""
    art = load(path)
    if not isinstance(art, ClientPosterior):
        raise SchemaError(str(path), "expected a client artifact (from fit-local), got a global one", "/")
    return art


def load_global(path: str | os.PathLike) -> GlobalEnsemble:
    """:func:`load`, insisting on a global artifact."""
    art = load(path)
    if not isinstance(art, GlobalEnsemble):
        raise SchemaError(str(path), "expected a global artifact (from fuse), got a client one", "/")
    return art
