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

import json
import math
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from posterior_fusion import budget
from posterior_fusion.artifact import schema
from posterior_fusion.artifact.blocks import (
    CURVATURE_MAX,
    ENCODINGS,
    GLOBAL_CURVATURE_MAX,
    BlockValueError,
    check_curvature_scale,
    dataset_dtypes,
)
from posterior_fusion.artifact.h5check import Checker as _Checker
from posterior_fusion.artifact.h5check import (
    file_sha256,  # noqa: F401 (public here too)
    open_file_sha256,
)
from posterior_fusion.artifact.h5check import open_artifact as _open
from posterior_fusion.artifact.privacy import check_privacy_records, recorded_epsilon_problem
from posterior_fusion.artifact.records import (
    BlockRecord,
    ClientMetadata,
    ComponentRecord,
    check_global_metadata,
    parse_layout,
    parse_training,
)
from posterior_fusion.curvature import BlockDiag, Precision
from posterior_fusion.errors import (
    ModelSpecError,
    NotAnArtifactError,
    SchemaError,
    UnsupportedVersionError,
)
from posterior_fusion.hdf5_safety import read_native
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.finetune import STATISTICS
from posterior_fusion.posterior import ClientPosterior, Component, GlobalEnsemble, SwagMoments, frozen_mapping


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
    if version not in schema.READABLE_VERSIONS:
        raise UnsupportedVersionError(chk.file, f"format_version {version} is not supported (this reader knows "
                                                f"{', '.join(map(str, schema.READABLE_VERSIONS))})", "/")
    chk.root_attributes(f)
    kind = chk.attr(f, "artifact_kind", "/", "text")
    if kind not in (schema.KIND_CLIENT, schema.KIND_GLOBAL):
        raise chk.bad_schema("/", f"artifact_kind {kind[:100]!r} must be 'client' or 'global'")
    spec_raw = chk.json_attr(f, "model_spec", "/")
    try:
        spec = ModelSpec.from_json(json.dumps(spec_raw))
    except ModelSpecError as exc:
        raise chk.bad_schema("/", f"model_spec: {exc}") from None
    layout = parse_layout(chk.json_attr(f, "layout", "/"))
    with torch.device("meta"):  # shapes only: a hostile spec allocates nothing
        expected = ParameterLayout.from_model(spec.build())
    if [(e.name, e.shape) for e in expected.entries] != [(e.name, e.shape) for e in layout.entries]:
        raise chk.bad_schema("/", f"layout does not match the parameters of model {spec.name!r} {spec.kwargs}")
    meta = chk.json_attr(f, "metadata", "/")
    if not isinstance(meta, dict):
        raise chk.bad_schema("/", "metadata must be a JSON object")
    shapes = spec.frozen_shapes()
    if shapes:
        chk.dataset(f, "/frozen", (sum(math.prod(shape) for _, shape in shapes),))
    elif "/frozen" in f:
        raise chk.bad_schema("/frozen", "only an artifact of a fine-tuning model spec (finetune) or with BatchNorm "
                                        "holds frozen weights")
    return str(kind), spec, layout, meta


def _with_frozen(chk: _Checker, f: h5py.File, spec: ModelSpec) -> ModelSpec:
    """``spec`` holding the base weights it freezes, read from ``/frozen`` (finite, bounded as weights)."""
    shapes = spec.frozen_shapes()
    if not shapes:
        return spec
    values = _read(chk, f["/frozen"], "/frozen", WEIGHT_MAX).float()
    sizes = [math.prod(shape) for _, shape in shapes]
    base = {name: t.reshape(shape) for (name, shape), t in zip(shapes, torch.split(values, sizes))}
    for name, t in base.items():
        if name.endswith("running_var") and bool((t < 0).any()):
            raise chk.bad_value("/frozen", f"the BatchNorm variance {name} has a negative entry ({float(t.min()):.3g})")
    return spec.with_base(base)


WEIGHT_MAX = 1e12  # a stored weight vector (MAP, member, student, SWAG mean) at most this in absolute value


def _read(chk: _Checker, ds: h5py.Dataset, where: str, bound: float | None = None) -> torch.Tensor:
    """A dataset's values, finite; ``bound``: each at most that in absolute value (weights: any sum or
    average of them the methods form stays finite in float32)."""
    try:
        arr = read_native(ds)
    except (OSError, ValueError, RuntimeError) as exc:
        raise NotAnArtifactError(chk.file, f"cannot read data (truncated or corrupt file?): {exc}", where) from None
    if not np.isfinite(arr).all():
        raise chk.bad_value(where, "contains NaN or Inf")
    if bound is not None and arr.size and float(np.abs(arr).max()) > bound:
        raise chk.bad_value(where, f"holds a weight beyond {bound:g} in absolute value")
    return torch.from_numpy(np.ascontiguousarray(arr))


def _client_plan(chk: _Checker, f: h5py.File, spec: ModelSpec, layout: ParameterLayout,
                 meta: dict) -> tuple[ClientMetadata, list[ComponentRecord]]:
    """Phase 1 for a client artifact: typed metadata and component records; reads no data."""
    typed = ClientMetadata.parse(meta, spec.num_classes)
    paths = chk.walk(f, schema.client_path_re())
    d = layout.dim
    records: list[ComponentRecord] = []
    for i in range(typed.num_components):
        base = f"/components/{i}"
        if base not in paths:
            raise chk.bad_schema(base, "missing component group")
        chk.dataset(f, f"{base}/map", (d,))
        training = parse_training(chk.json_attr(f[base], "training", base), base)
        if f"{base}/curvature" not in paths:
            raise chk.bad_schema(f"{base}/curvature", "missing curvature group")
        blocks = ComponentRecord.parse_blocks(
            chk.json_attr(f[f"{base}/curvature"], "blocks", f"{base}/curvature"), f"{base}/curvature", layout)
        rank = None
        if f"{base}/swag" in paths:
            dev = f.get(f"{base}/swag/deviations")
            if not isinstance(dev, h5py.Dataset) or dev.ndim != 2 or not 1 <= dev.shape[0] <= schema.MAX_SWAG_RANK:
                raise chk.bad_schema(f"{base}/swag/deviations", f"must be (K, d) with 1 <= K <= {schema.MAX_SWAG_RANK}")
            rank = dev.shape[0]
            for name, shape in (("mean", (d,)), ("sq_mean", (d,)), ("deviations", (rank, d))):
                chk.dataset(f, f"{base}/swag/{name}", shape)
        has_student = f"{base}/ppd_student" in paths
        if has_student:
            chk.dataset(f, f"{base}/ppd_student", (d,))
        has_statistics = f"{base}/statistics" in paths
        if has_statistics:
            size = statistics_size(spec)
            if not size:
                raise chk.bad_schema(f"{base}/statistics", "only a model with BatchNorm has BatchNorm statistics")
            chk.dataset(f, f"{base}/statistics", (size,))
        record = ComponentRecord(i, training, blocks, rank, has_student, has_statistics)
        for j, b in enumerate(blocks):
            for name, shape in b.datasets.items():
                chk.dataset(f, f"{base}/curvature/{j}/{name}", shape, dataset_dtypes(b.kind, name, schema.FLOAT_DTYPES))
        records.append(record)
    if "/prior_mean" in paths:
        chk.dataset(f, "/prior_mean", (d,))
    expected_groups = {f"/components/{i}" for i in range(typed.num_components)}
    extra = {p for p in paths if p.count("/") == 2} - expected_groups
    if extra:
        raise chk.bad_schema(sorted(extra)[0], f"component not declared by num_components={typed.num_components}")
    expected_blocks = set()
    for r in records:
        expected_blocks |= {f"/components/{r.index}/curvature/{j}" for j in range(len(r.blocks))}
        expected_blocks |= set(r.dataset_paths())
    extra = {p for p in paths if "/curvature/" in p} - expected_blocks
    if extra:
        raise chk.bad_schema(sorted(extra)[0], "object not declared by the curvature 'blocks' attribute")
    check_privacy_records(meta, [r.training for r in records])
    return typed, records


def statistics_size(spec: ModelSpec) -> int:
    """Length of a component's folded BatchNorm ``statistics`` for ``spec`` (0 without BatchNorm)."""
    return sum(math.prod(shape) for name, shape in spec.frozen_shapes() if name.endswith(STATISTICS))


def variance_mask(spec: ModelSpec) -> torch.Tensor:
    """``(2 S,)`` bool: which entries of a ``statistics`` vector are variances."""
    return torch.cat([torch.full((math.prod(shape),), name.endswith("running_var"))
                      for name, shape in spec.frozen_shapes() if name.endswith(STATISTICS)] or [torch.zeros(0, dtype=torch.bool)])


def _client(chk: _Checker, f: h5py.File, typed: ClientMetadata, records: list[ComponentRecord],
            spec: ModelSpec, keep_curvature: bool = True) -> list[Component]:
    """Phase 2 for a client artifact: read and check values; each block is rebuilt by its class (and, without
    ``keep_curvature``, dropped once checked)."""
    comps = []
    for r in records:
        base = f"/components/{r.index}"
        w = _read(chk, f[f"{base}/map"], f"{base}/map", WEIGHT_MAX)
        curvature = _blocks(chk, f, f"{base}/curvature", r.blocks, keep=keep_curvature)
        swag = None
        if r.swag_rank is not None:
            swag = SwagMoments(*(_read(chk, f[f"{base}/swag/{n}"], f"{base}/swag/{n}")
                                 for n in ("mean", "sq_mean", "deviations")))
        student = (_read(chk, f[f"{base}/ppd_student"], f"{base}/ppd_student", WEIGHT_MAX) if r.has_student
                   else None)
        statistics = None
        if r.has_statistics:
            statistics = _read(chk, f[f"{base}/statistics"], f"{base}/statistics", WEIGHT_MAX).float()
            if statistics[variance_mask(spec)].lt(0).any():
                raise chk.bad_value(f"{base}/statistics", "holds a negative variance")
        comps.append(Component(r.index, w, curvature, frozen_mapping(r.training),
                               typed.temperature, typed.prior_precision, swag, student, statistics))
    return comps


def _global_plan(chk: _Checker, f: h5py.File, layout: ParameterLayout, meta: dict,
                 num_classes: int) -> tuple[int, list[tuple[BlockRecord, ...]] | None]:
    """Phase 1 for a global artifact: members and, if present, each member's Laplace curvature."""
    n = meta.get("num_members")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= schema.MAX_MEMBERS:
        raise chk.bad_schema("/", f"metadata num_members must be an integer in [1, {schema.MAX_MEMBERS}]")
    paths = chk.walk(f, schema.global_path_re())
    expected = {"/members"} | {f"/members/{i}" for i in range(n)} | {f"/members/{i}/weights" for i in range(n)}
    if "/frozen" in f:  # the frozen weights of a fine-tuning spec: checked with the header (_header)
        expected.add("/frozen")
    with_curvature = "/members/0/curvature" in paths
    records = None
    if with_curvature:
        records = []
        for i in range(n):
            where = f"/members/{i}/curvature"
            if where not in paths:
                raise chk.bad_schema(where, "every member needs curvature when one has it")
            blocks = ComponentRecord.parse_blocks(chk.json_attr(f[where], "blocks", where), where, layout)
            expected |= {where} | {f"{where}/{j}" for j in range(len(blocks))}
            for j, b in enumerate(blocks):
                for name, shape in b.datasets.items():
                    expected.add(f"{where}/{j}/{name}")
                    chk.dataset(f, f"{where}/{j}/{name}", shape, dataset_dtypes(b.kind, name, schema.FLOAT_DTYPES))
            records.append(blocks)
    if paths != expected:
        bad = sorted(paths ^ expected)[0]
        raise chk.bad_schema(bad, "members do not match metadata num_members and their curvature headers")
    for i in range(n):
        chk.dataset(f, f"/members/{i}/weights", (layout.dim,))
    check_global_metadata(meta, n, with_curvature, num_classes, len(records[0]) if records else 0)
    return n, records


def _blocks(chk: _Checker, f: h5py.File, base: str, records: tuple[BlockRecord, ...],
            limit: float = CURVATURE_MAX, keep: bool = True) -> BlockDiag | None:
    """Read and check the curvature blocks under ``base`` (each rebuilt by its class, its largest
    eigenvalue within ``limit``: :func:`~posterior_fusion.artifact.blocks.check_curvature_scale`); ``keep``
    False: each block is dropped once checked (one block held at a time) and None returned."""
    parts: list[Precision] = []
    for j, b in enumerate(records):
        where = f"{base}/{j}"
        tensors = {name: _read(chk, f[f"{where}/{name}"], f"{where}/{name}") for name in b.datasets}
        try:
            block = ENCODINGS[b.kind].decode(tensors, {**b.fields, "size": b.size})
            check_curvature_scale(block, limit)
        except BlockValueError as exc:
            raise chk.bad_value(f"{where}/{exc.name}", exc.message) from None
        if keep:
            parts.append(block)
        del tensors, block
    return BlockDiag(parts) if keep else None


def _global(chk: _Checker, f: h5py.File, layout: ParameterLayout, meta: dict,
            num_classes: int) -> tuple[list[torch.Tensor], list[BlockDiag] | None]:
    n, records = _global_plan(chk, f, layout, meta, num_classes)
    members = [_read(chk, f[f"/members/{i}/weights"], f"/members/{i}/weights", WEIGHT_MAX) for i in range(n)]
    if records is None:
        return members, None
    return members, [_blocks(chk, f, f"/members/{i}/curvature", r, GLOBAL_CURVATURE_MAX) for i, r in enumerate(records)]


def _dataset_bytes(chk: _Checker, f: h5py.File, kind: str) -> dict[str, int]:
    """Each dataset's bytes once loaded (float16 eigenvectors are held as float32), by path."""
    pattern = schema.client_path_re() if kind == schema.KIND_CLIENT else schema.global_path_re()
    return {p: f[p].size * max(f[p].dtype.itemsize, 4 if f[p].dtype.kind == "f" else 1)
            for p in chk.walk(f, pattern) if isinstance(f[p], h5py.Dataset)}


def declared_bytes(path: str | os.PathLike) -> dict[str, Any]:
    """Validate an artifact's header (phase 1 only) and report its size without reading data.

    Returns ``{"kind", "num_params", "num_components", "num_classes", "data_bytes", "dense_bytes",
    "curvature_bytes", "largest_block_bytes"}``, where ``data_bytes`` is the in-memory size of every dataset once
    loaded (``curvature_bytes`` of them the client components' curvature, ``largest_block_bytes`` its largest
    block's) and ``dense_bytes`` adds, for every
    compressed Kronecker block, its two factors as dense float32 matrices (what a method or predictive that
    rebuilds, decomposes or stacks them holds: the working-set estimates count it).
    """
    with _open(Path(path)) as (chk, f):
        kind, spec, layout, meta = _header(chk, f)
        blocks: list[BlockRecord] = []
        if kind == schema.KIND_CLIENT:
            blocks = [b for r in _client_plan(chk, f, spec, layout, meta)[1] for b in r.blocks]
        else:
            records = _global_plan(chk, f, layout, meta, spec.num_classes)[1] or []
            blocks = [b for r in records for b in r]
        sizes = _dataset_bytes(chk, f, kind)
    total = sum(sizes.values())
    blocks_bytes: dict[str, int] = {}
    for p, n in sizes.items():  # /components/<i>/curvature/<j>/<name>
        parts = p.split("/")
        if len(parts) == 6 and parts[1] == "components" and parts[3] == "curvature":
            blocks_bytes["/".join(parts[:5])] = blocks_bytes.get("/".join(parts[:5]), 0) + n
    # a compact Kronecker block as the methods and predictives that rebuild or decompose it hold it: two dense factors
    dense = sum(4 * (b.fields["shape"][0] ** 2 + b.fields["shape"][1] ** 2) for b in blocks if b.kind == "kron_lowrank")
    return {"kind": kind, "num_params": layout.dim, "num_components": meta.get("num_components", meta.get("num_members")),
            "num_classes": spec.num_classes, "data_bytes": total, "dense_bytes": total + dense,
            "curvature_bytes": sum(blocks_bytes.values()), "largest_block_bytes": max(blocks_bytes.values(), default=0)}


def load(path: str | os.PathLike, max_memory: int | str | None = None,
         keep_curvature: bool = True) -> ClientPosterior | GlobalEnsemble:
    """Validate and load an artifact (the header first, then every value; nothing is read before the header passed).

    The bytes the load would allocate are checked against the memory budget before any data is read.

    Args:
        path: a client artifact (from ``fit-local``) or a global one (from ``fuse``).
        max_memory: the memory limit, bytes or a size such as ``"8G"`` [default: 80% of available memory, or
            ``$PFUSE_MAX_MEMORY``; :mod:`posterior_fusion.budget`].
        keep_curvature: False (a client artifact): every curvature block is read and checked as always, then
            dropped, and the components' ``curvature`` is None — one block in memory at a time instead of the whole
            artifact's (what a fusion that reads no curvature loads).

    Returns:
        :class:`ClientPosterior` or :class:`GlobalEnsemble`, tensors of ``d`` parameters each.

    Raises:
        ArtifactError: a subclass naming the file and HDF5 path (or ``ResourceLimitError`` over the budget).
    """
    path = Path(path)
    with _open(path) as (chk, f):
        kind, spec, layout, meta = _header(chk, f)
        plan = _client_plan(chk, f, spec, layout, meta) if kind == schema.KIND_CLIENT else None
        if plan is not None and isinstance(meta.get("dp"), dict):
            try:  # the recorded ε against the accountant on the recorded mechanisms (without Opacus: claimed)
                problem = recorded_epsilon_problem(meta["dp"])
            except ImportError:
                problem = None
            if problem is not None:
                raise chk.bad_value("/", f"metadata field 'dp': {problem}")
        if kind != schema.KIND_CLIENT:
            _global_plan(chk, f, layout, meta, spec.num_classes)
        budget.require(2 * sum(_dataset_bytes(chk, f, kind).values()), f"loading {path}", max_memory)
        if plan is not None:
            comps = _client(chk, f, *plan, spec, keep_curvature)
            prior_mean = _read(chk, f["/prior_mean"], "/prior_mean", WEIGHT_MAX) if "/prior_mean" in f else None
        else:
            members, precisions = _global(chk, f, layout, meta, spec.num_classes)
        spec = _with_frozen(chk, f, spec)
        sha = open_file_sha256(f)  # the bytes that were validated, through the same open file
    if kind == schema.KIND_CLIENT:
        return ClientPosterior(str(path), sha, spec, layout, frozen_mapping(meta), tuple(comps), prior_mean)
    return GlobalEnsemble(str(path), sha, spec, layout, frozen_mapping(meta), tuple(members),
                          None if precisions is None else tuple(precisions))


def load_client(path: str | os.PathLike, max_memory: int | str | None = None,
                keep_curvature: bool = True) -> ClientPosterior:
    """:func:`load`, insisting on a client artifact."""
    art = load(path, max_memory, keep_curvature)
    if not isinstance(art, ClientPosterior):
        raise SchemaError(str(path), "expected a client artifact (from fit-local), got a global one", "/")
    return art


def load_global(path: str | os.PathLike, max_memory: int | str | None = None) -> GlobalEnsemble:
    """:func:`load`, insisting on a global artifact."""
    art = load(path, max_memory)
    if not isinstance(art, GlobalEnsemble):
        raise SchemaError(str(path), "expected a global artifact (from fuse), got a client one", "/")
    return art
