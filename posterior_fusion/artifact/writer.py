"""Writers for client and global artifacts (atomic; see ``docs/artifact-format.md``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from posterior_fusion.artifact import schema
from posterior_fusion.artifact.blocks import ENCODINGS, PSD_DATASETS, storable_psd
from posterior_fusion.artifact.reader import load
from posterior_fusion.artifact.schema import FORMAT_NAME, FORMAT_VERSION, KIND_CLIENT, KIND_GLOBAL
from posterior_fusion.curvature import BlockDiag
from posterior_fusion.curvature.compressed import PLAIN, Compression
from posterior_fusion.errors import ArtifactError, NonFiniteOutputError, OutputError
from posterior_fusion.files import atomic_h5_write
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component

COMPRESSION_KEYS = ("compress", "compress_metric", "compress_vectors")  # metadata the writer records


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def require_finite(path: str | os.PathLike, what: str, value: torch.Tensor | np.ndarray, step: str) -> None:
    """Refuse to write ``path`` when ``value`` holds NaN or Inf; the message names the step that made it."""
    arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise NonFiniteOutputError(f"{path}: not written: {what} holds {bad} NaN/Inf values (produced by {step})")


def metadata_json(path: str | os.PathLike, metadata: dict) -> str:
    """Strict JSON of ``metadata``: NaN or Inf anywhere is refused, naming the field."""
    try:
        return json.dumps(metadata, sort_keys=True, allow_nan=False)
    except ValueError:
        bad = _non_finite_field(metadata, "metadata")
        raise NonFiniteOutputError(f"{path}: not written: {bad} is NaN or Inf") from None


def _non_finite_field(obj: Any, where: str) -> str:
    if isinstance(obj, float) and not math.isfinite(obj):
        return where
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = _non_finite_field(v, f"{where}.{k}" if isinstance(obj, dict) else f"{where}[{k}]")
        if found:
            return found
    return ""


def text_attr(text: str) -> np.bytes_:
    """Strings are stored as fixed-length UTF-8 so a reader can check their size before reading."""
    return np.bytes_(text.encode("utf-8"))


def _root(f: h5py.File, kind: str, spec: ModelSpec, layout: ParameterLayout, metadata: dict) -> None:
    """The root attributes and, for a fine-tuning spec, its frozen base weights once as ``/frozen``."""
    meta_text = metadata_json(f.filename, metadata)
    if spec.frozen_shapes():
        frozen = spec.frozen_vector()
        require_finite(f.filename, "/frozen", frozen, "the base")
        f.create_dataset("frozen", data=_np(frozen))
    f.attrs["format"] = text_attr(FORMAT_NAME)
    f.attrs["format_version"] = np.int64(FORMAT_VERSION)
    f.attrs["artifact_kind"] = text_attr(kind)
    f.attrs["model_spec"] = text_attr(spec.to_json())
    f.attrs["layout"] = text_attr(json.dumps(layout.to_json()))
    f.attrs["metadata"] = text_attr(meta_text)


def write_curvature(group: h5py.Group, curvature: BlockDiag, dtype: torch.dtype | None = None,
                    step: str = "the curvature capture", compression: Compression = PLAIN,
                    prior: float | None = None) -> None:
    """``group/curvature``: one subgroup per block (its class's datasets) and the ``blocks`` header;
    with a ``compression`` budget > 0 the kinds that have a compact encoding use it
    (``prior = λ0·T``: the precision metric's, :mod:`posterior_fusion.curvature.compressed`)."""
    curv = group.create_group("curvature")
    descr: list[dict[str, Any]] = []
    for i, (block, off) in enumerate(zip(curvature.blocks, curvature.offsets)):
        encoding = ENCODINGS[block.kind]
        if compression.budget > 0 and encoding.compress is not None:
            kind, header, tensors = encoding.compress(block, compression, prior)
        else:
            kind, header, tensors = block.kind, encoding.header(block), block.to_tensors()
        descr.append({"kind": kind, "offset": off, "size": block.dim, **header})
        g = curv.create_group(str(i))
        for name, tensor in tensors.items():
            tensor = tensor if dtype is None else tensor.to(dtype)
            data = _np(storable_psd(tensor) if name in PSD_DATASETS else tensor)
            require_finite(group.file.filename, f"{group.name}/curvature/{i}/{name}", data, step)
            g.create_dataset(name, data=data)
    curv.attrs["blocks"] = text_attr(json.dumps(descr))


def write_component(group: h5py.Group, comp: Component, compression: Compression = PLAIN) -> None:
    """Write one component (MAP, raw curvature blocks, training info, SWAG) into ``group``."""
    path = group.file.filename
    group.attrs["training"] = text_attr(metadata_json(path, dict(comp.training)))
    require_finite(path, f"{group.name}/map", comp.map, "training")
    group.create_dataset("map", data=_np(comp.map))
    prior = comp.prior_precision * comp.temperature if compression.metric == "precision" else None
    write_curvature(group, comp.curvature, compression=compression, prior=prior)
    if comp.swag is not None:
        s = group.create_group("swag")
        for name in ("mean", "sq_mean", "deviations"):
            require_finite(path, f"{group.name}/swag/{name}", getattr(comp.swag, name), "SWAG")
            s.create_dataset(name, data=_np(getattr(comp.swag, name)))
    if comp.student is not None:
        require_finite(path, f"{group.name}/ppd_student", comp.student, "the FedPPD student")
        group.create_dataset("ppd_student", data=_np(comp.student))
    if comp.statistics is not None:
        require_finite(path, f"{group.name}/statistics", comp.statistics, "the BatchNorm statistics")
        group.create_dataset("statistics", data=_np(comp.statistics))


def readable(path: str | os.PathLike) -> Callable[[Path], None]:
    """The check every artifact writer runs on its finished file before it takes ``path``'s place: the
    reader's own validation (:func:`~posterior_fusion.artifact.reader.load`), so no writer leaves a file
    its reader refuses; a refusal is one :class:`OutputError` line naming ``path``, nothing written."""
    def check(tmp: Path) -> None:
        try:
            load(tmp, max_memory=2**62)  # the writer held all of it in memory already
        except ArtifactError as exc:
            why = str(exc).replace(str(tmp), "").lstrip(": ")
            raise OutputError(f"{path}: not written: its own reader would refuse it ({why})") from None
    return check


def write_client_artifact(
    path: str | os.PathLike, spec: ModelSpec, layout: ParameterLayout,
    metadata: dict[str, Any], components: Sequence[Component], compression: Compression = PLAIN,
    prior_mean: torch.Tensor | None = None,
) -> None:
    """Write a client artifact atomically. ``metadata`` must hold at least ``n_data``,
    ``class_counts``, ``temperature``, ``prior_precision`` and ``structure``. A ``compression``
    budget > 0: Kronecker factors stored as top-r eigenpairs plus an isotropic remainder within that
    relative error per factor, in its metric (``frobenius`` or ``precision``), eigenvectors float16 where
    asked (:mod:`posterior_fusion.curvature.compressed`; recorded per block and as metadata ``compress``,
    ``compress_metric``, ``compress_vectors``, whatever ``metadata`` said; readers use the compact form).
    ``prior_mean`` ``(d,)``: the centre of the components' prior N(prior_mean, λ0⁻¹ I) when it is not zero (the
    pretrained base), stored as ``/prior_mean``."""
    meta = dict(metadata, num_components=len(components))
    for key in COMPRESSION_KEYS:  # recorded here, from what is written, and only here
        meta.pop(key, None)
    if compression.budget > 0:
        meta["compress"] = compression.budget
        if compression.metric != schema.COMPRESSION_UNRECORDED["compress_metric"]:
            meta["compress_metric"] = compression.metric
        if compression.vectors != schema.COMPRESSION_UNRECORDED["compress_vectors"]:
            meta["compress_vectors"] = compression.vectors

    def fill(f: h5py.File) -> None:
        _root(f, KIND_CLIENT, spec, layout, meta)
        if prior_mean is not None:
            require_finite(path, "/prior_mean", prior_mean, "the base")
            f.create_dataset("prior_mean", data=_np(prior_mean.to(torch.float32)))
        comps = f.create_group("components")
        for comp in components:
            write_component(comps.create_group(str(comp.index)), comp, compression)

    atomic_h5_write(path, fill, readable(path))


def write_global_artifact(
    path: str | os.PathLike, spec: ModelSpec, layout: ParameterLayout,
    metadata: dict[str, Any], members: Sequence[torch.Tensor], precisions: Sequence[BlockDiag] | None = None,
) -> None:
    """Write a fused ensemble atomically; ``members`` are flat ``(d,)`` weight vectors and
    ``precisions`` (optional) the raw curvature of each member's Laplace approximation."""
    meta = dict(metadata, num_members=len(members))
    if precisions is not None and len(precisions) != len(members):
        raise ValueError("one precision per member is needed")

    def fill(f: h5py.File) -> None:
        _root(f, KIND_GLOBAL, spec, layout, meta)
        g = f.create_group("members")
        step = f"the fusion ({metadata.get('method', '?')})"
        for i, w in enumerate(members):
            member = g.create_group(str(i))
            require_finite(path, f"/members/{i}/weights", w.to(torch.float32), step)
            member.create_dataset("weights", data=_np(w.to(torch.float32)))
            if precisions is not None:
                write_curvature(member, precisions[i], torch.float32, "the Laplace approximation at the modes")

    atomic_h5_write(path, fill, readable(path))


def write_predictions(path: str | os.PathLike, probs: torch.Tensor, attrs: dict[str, str | float],
                      class_names: Sequence[str] = ()) -> None:
    """Write ``probs`` ``(n, classes)`` to the HDF5 file ``path`` (``/probs``, the predicted class index
    per row ``/predicted``, and ``attrs``; with ``class_names`` the attribute ``class_names``, a JSON list,
    so ``class_names[predicted[i]]`` is row i's class) atomically, after checking they are probabilities:
    finite, in [0, 1], each row summing to 1."""
    p = probs.detach().double()
    rows = p.sum(-1)
    if not torch.isfinite(p).all() or p.min() < 0 or p.max() > 1 + 1e-6 or not torch.allclose(rows, torch.ones_like(rows), atol=1e-4):
        raise NonFiniteOutputError(f"{path}: not written: the predictive ({attrs.get('predictive', '?')}) produced "
                                   "values that are not probabilities (NaN/Inf, outside [0, 1] or rows not summing to 1)")

    def fill(f: h5py.File) -> None:
        f.attrs["format"] = "posterior-fusion-predictions"
        for key, value in attrs.items():
            f.attrs[key] = value
        f.create_dataset("probs", data=probs.detach().cpu().numpy().astype(np.float32))
        f.create_dataset("predicted", data=probs.detach().argmax(-1).cpu().numpy().astype(np.int64))
        if class_names:
            f.attrs["class_names"] = text_attr(json.dumps(list(class_names)))

    atomic_h5_write(path, fill)
