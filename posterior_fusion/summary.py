"""Summaries of artifacts for ``pfuse inspect`` and notebooks."""

from __future__ import annotations

import os
from collections import Counter

from posterior_fusion.artifact import ClientPosterior, GlobalEnsemble


def summarize(art: ClientPosterior | GlobalEnsemble) -> dict:
    """A JSON-serialisable description of an artifact."""
    d = art.layout.dim
    out = {
        "file": art.path, "sha256": art.sha256, "file_bytes": os.path.getsize(art.path),
        "kind": "client" if isinstance(art, ClientPosterior) else "global",
        "model": {"name": art.model_spec.name, "kwargs": dict(art.model_spec.kwargs),
                  **({"provider": art.model_spec.provider} if art.model_spec.provider else {})},
        "num_params": d,
        "layout": [{"name": e.name, "shape": list(e.shape), "offset": e.offset} for e in art.layout.entries],
        "metadata": dict(art.metadata),
    }
    if isinstance(art, ClientPosterior):
        comps = []
        for c in art.components:
            kinds = Counter(type(b).__name__ for b in c.curvature.blocks)
            curv_bytes = c.curvature.nbytes
            comps.append({
                "index": c.index, "blocks": dict(kinds), "curvature_bytes": curv_bytes,
                "curvature_bytes_per_param": round(curv_bytes / c.map.element_size() / d, 3),
                "swag_rank": None if c.swag is None else int(c.swag.deviations.shape[0]),
                "training": dict(c.training),
            })
        out["structure"] = art.structure
        out["components"] = comps
    else:
        out["method"] = art.method
        out["num_members"] = len(art.members)
    return out

