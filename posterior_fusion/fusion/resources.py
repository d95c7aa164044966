"""Memory estimate for ``fuse``, computed from artifact and data headers before any data is loaded."""

from __future__ import annotations

from posterior_fusion.fusion.registry import get_method
from posterior_fusion.fusion.settings import MethodSettings


def estimate_fuse_bytes(headers: list[dict], method: str, settings: MethodSettings, data_bytes: int = 0,
                        data_rows: int = 0, num_classes: int = 10) -> int:
    """Peak-memory estimate of a fusion from ``declared_bytes`` of each client artifact and
    the declared size of the server's data files (``data_bytes``, ``data_rows`` samples).

    Loaded tensors (1x) + eigendecompositions and stacked float32 copies (2x) for the
    curvature methods; the optimisers also hold K x N rotated copies of the parameter vector
    with their autograd buffers (about 4 of them); sampling methods hold their members; data
    files are converted to float32 (4 bytes per stored byte at most) and their logits are
    kept per member.
    """
    d = headers[0]["num_params"]
    n = sum(h["num_components"] for h in headers)
    total = 3 * sum(h["data_bytes"] for h in headers)
    members = 1
    if get_method(method).optimises:
        k = getattr(settings, "modes", None) or headers[0]["num_components"] if method == "fedbens" else 1
        total += 4 * k * n * d * 4
        members = k
    samples = getattr(settings, "num_samples", 0)
    if method == "fedbe":
        members = 1 + len(headers) + samples
    elif method == "swag":
        members = n * max(1, samples)
    elif method == "ensemble":
        members = n
    total += 2 * members * d * 4
    total += 4 * data_bytes + members * data_rows * num_classes * 4
    return int(total)
