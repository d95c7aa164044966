"""What an artifact says about itself, read from its header without importing torch (``pfuse
inspect``, well under a second). Attributes go through the same typed, size-capped readers and
strict JSON as the full reader, and the file's structure is checked as the reader checks it (every
object a plain group or dataset on the schema's paths, no links, the root attributes the schema
names, the privacy records' schema); the model spec against the layout and the values are not —
``pfuse inspect --validate`` (the reader, :func:`posterior_fusion.artifact.load`) checks those.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

import h5py

from posterior_fusion.artifact import schema
from posterior_fusion.artifact.h5check import Checker, file_sha256, open_artifact
from posterior_fusion.artifact.privacy import check_privacy_records
from posterior_fusion.errors import NotAnArtifactError, UnsupportedVersionError


def _nbytes(obj: Any) -> int:
    return int(obj.size * obj.dtype.itemsize) if isinstance(obj, h5py.Dataset) else 0


def _structure(chk: Checker, f: h5py.File) -> tuple[int, str]:
    """The root attributes and every object checked as the reader checks them (module doc); ``(version, kind)``."""
    for name in ("format", "format_version", "artifact_kind"):
        if name not in f.attrs:
            raise NotAnArtifactError(chk.file, f"missing root attribute {name!r}: not a posterior-fusion artifact", "/")
    if chk.attr(f, "format", "/", "text") != schema.FORMAT_NAME:
        raise NotAnArtifactError(chk.file, f"format is not {schema.FORMAT_NAME!r}", "/")
    version = chk.attr(f, "format_version", "/", "int")
    if version not in schema.READABLE_VERSIONS:
        raise UnsupportedVersionError(chk.file, f"format_version {version} is not supported", "/")
    kind = chk.attr(f, "artifact_kind", "/", "text")
    if kind not in (schema.KIND_CLIENT, schema.KIND_GLOBAL):
        raise chk.bad_schema("/", f"artifact_kind {kind[:100]!r} must be 'client' or 'global'")
    chk.root_attributes(f)
    pattern = schema.client_path_re if kind == schema.KIND_CLIENT else schema.global_path_re
    chk.walk(f, pattern(schema.ANY_DATASET_NAME))
    return version, kind


def artifact_kind(path: str | os.PathLike) -> str:
    """``client`` or ``global``, once the file's structure is checked as :func:`preview` checks it (torch-free, no
    data read and no hash: what ``evaluate`` and ``predict`` check before torch is imported)."""
    from pathlib import Path

    with open_artifact(Path(path)) as (chk, f):
        return _structure(chk, f)[1]


def preview(path: str | os.PathLike) -> dict[str, Any]:
    """``{file, file_bytes, sha256, kind, format_version, model, num_params, layout, metadata,
    components | num_members}`` from the header (dataset sizes from their metadata, no data read)."""
    from pathlib import Path

    path = Path(path)
    with open_artifact(path) as (chk, f):
        version, kind = _structure(chk, f)
        model = chk.json_attr(f, "model_spec", "/")
        layout = chk.json_attr(f, "layout", "/")
        meta = chk.json_attr(f, "metadata", "/")
        entries, offset = [], 0
        for e in layout if isinstance(layout, list) else []:
            shape = e.get("shape", []) if isinstance(e, dict) else []
            shape = [s for s in shape if isinstance(s, int) and not isinstance(s, bool)] if isinstance(shape, list) else []
            size = math.prod(shape)
            entries.append({"name": str(e.get("name", "?")) if isinstance(e, dict) else "?", "shape": shape,
                            "offset": offset})
            offset += size
        out: dict[str, Any] = {
            "file": str(path), "file_bytes": os.path.getsize(path), "sha256": file_sha256(path), "kind": kind,
            "format_version": version, "model": model if isinstance(model, dict) else {"name": "?", "kwargs": {}},
            "num_params": offset, "layout": entries, "metadata": meta if isinstance(meta, dict) else {},
        }
        if kind == schema.KIND_CLIENT:
            comps = []
            group = f.get("components")
            if isinstance(group, h5py.Group) and len(group) > schema.MAX_COMPONENTS:
                raise chk.bad_schema("/components", f"more than {schema.MAX_COMPONENTS} components")
            for key in sorted(group.keys(), key=lambda k: int(k) if k.isdigit() else -1) if isinstance(group, h5py.Group) else []:
                base = f"/components/{key}"
                curv = f.get(f"{base}/curvature")
                if isinstance(curv, h5py.Group) and len(curv) > schema.MAX_BLOCKS:
                    raise chk.bad_schema(f"{base}/curvature", f"more than {schema.MAX_BLOCKS} blocks")
                blocks = chk.json_attr(curv, "blocks", f"{base}/curvature") if isinstance(curv, h5py.Group) else []
                curv_bytes = sum(_nbytes(d) for g in curv.values() if isinstance(g, h5py.Group) for d in g.values()) \
                    if isinstance(curv, h5py.Group) else 0
                dev = f.get(f"{base}/swag/deviations")
                comps.append({
                    "index": int(key) if key.isdigit() else key,
                    "blocks": dict(Counter(str(b.get("kind")) for b in blocks if isinstance(b, dict))),
                    "curvature_bytes": curv_bytes,
                    # curvature entries per parameter (curvature bytes / MAP bytes)
                    "curvature_bytes_per_param": round(curv_bytes / max(1, _nbytes(f.get(f"{base}/map"))), 3),
                    "swag_rank": int(dev.shape[0]) if isinstance(dev, h5py.Dataset) and dev.ndim == 2 else None,
                    "ppd_student": f"{base}/ppd_student" in f,
                    "training": chk.json_attr(f[base], "training", base) if isinstance(f.get(base), h5py.Group) else {},
                })
            # the privacy records are read as their schema even here: a malformed or forged one is never shown
            check_privacy_records(out["metadata"], [c["training"] for c in comps])
            out["structure"] = out["metadata"].get("structure")
            out["prior_centre"] = "base" if isinstance(f.get("prior_mean"), h5py.Dataset) else "zero"
            out["components"] = comps
        else:
            members = f.get("members")
            out["method"] = out["metadata"].get("method", "?")
            out["num_members"] = len(members) if isinstance(members, h5py.Group) else 0
        return out
