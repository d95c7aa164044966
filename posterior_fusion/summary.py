"""Summaries of artifacts for ``pfuse inspect`` and notebooks."""

from __future__ import annotations

import os
from collections import Counter

from posterior_fusion.artifact import ClientPosterior, GlobalEnsemble
from posterior_fusion.artifact.schema import COMPRESSION_UNRECORDED


def summarize(art: ClientPosterior | GlobalEnsemble) -> dict:
    """A JSON-serialisable description of an artifact."""
    d = art.layout.dim
    out = {
        "file": art.path, "sha256": art.sha256, "file_bytes": os.path.getsize(art.path),
        "kind": "client" if isinstance(art, ClientPosterior) else "global",
        "model": {"name": art.model_spec.name, "kwargs": dict(art.model_spec.kwargs),
                  **({"provider": art.model_spec.provider} if art.model_spec.provider else {}),
                  **({"finetune": art.model_spec.finetune} if art.model_spec.finetune != "all" else {})},
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
        out["prior_centre"] = "zero" if art.prior_mean is None else "base"  # the prior N(centre, λ0⁻¹ I)
        out["components"] = comps
        if art.metadata.get("compress"):
            out["compression"] = compression_errors(art)
    else:
        out["method"] = art.method
        out["num_members"] = len(art.members)
    return out



def compression_errors(art: ClientPosterior) -> list[dict]:
    """Per compressed layer (a ``kron_lowrank`` block), over the components, the largest recorded error
    per factor in the artifact's metric and the error in the precision metric fusion sees
    (:func:`~posterior_fusion.curvature.compressed.precision_errors`: the recorded one, or an upper bound
    where the artifact was compressed in the Frobenius metric)."""
    from posterior_fusion.curvature.compressed import CompressedKron, precision_errors

    metric = art.metadata.get("compress_metric", COMPRESSION_UNRECORDED["compress_metric"])
    names = {e.offset: e.name for e in art.layout.entries}
    rows: dict[int, dict] = {}
    for c in art.components:
        for block, off in zip(c.curvature.blocks, c.curvature.offsets):
            if not isinstance(block, CompressedKron):
                continue
            seen = precision_errors(block, c.prior_precision * c.temperature, metric)
            row = rows.setdefault(off, {"name": names.get(off, str(off)), "shape": list(block.shape),
                                        "rank": [0, 0], "recorded": [0.0, 0.0], "precision_metric": [0.0, 0.0]})
            row["rank"] = [max(row["rank"][0], block.lB.numel()), max(row["rank"][1], block.lA.numel())]
            row["recorded"] = [max(a, b) for a, b in zip(row["recorded"], block.errors)]
            row["precision_metric"] = [max(a, b) for a, b in zip(row["precision_metric"], seen)]
    return [dict(rows[off], metric=metric, precision_metric_is_bound=metric != "precision") for off in sorted(rows)]
