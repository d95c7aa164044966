"""Memory estimate for ``fuse``, computed from artifact and data headers before any data is loaded."""

from __future__ import annotations

from posterior_fusion.curvature.kron import CHUNK_BYTES
from posterior_fusion.fusion.registry import get_method
from posterior_fusion.fusion.settings import MethodSettings


def estimate_fuse_bytes(headers: list[dict], method: str, settings: MethodSettings, data_bytes: int = 0,
                        data_rows: int = 0, num_classes: int = 10) -> int:
    """Peak-memory estimate of a fusion from ``declared_bytes`` of each client artifact and
    the declared size of the server's data files (``data_bytes``, ``data_rows`` samples).

    Loaded tensors (1x) + eigendecompositions and stacked float32 copies (2x) for the
    curvature methods. fedbens evaluates its K modes against one chunk of clients at a time
    (``GlobalLogPosterior``: about 3·K·d numbers per component, chunks of ≤ ``CHUNK_BYTES`` or one
    client) and holds K parameter vectors with their gradient, Adam moments and best iterate;
    the one-mode optimisers (fedfisher, hbfl) keep about 4 copies of the parameter vector per
    component for autograd; sampling methods hold their members; data files are converted to
    float32 (4 bytes per stored byte at most) and their logits are kept per member.
    """
    d = headers[0]["num_params"]
    n = sum(h["num_components"] for h in headers)
    total = 3 * sum(h["data_bytes"] for h in headers)
    members = 1
    if method == "fedbens":
        modes = getattr(settings, "modes", None) or headers[0]["num_components"]
        k = {"median": modes, "clients": n, "median+clients": modes + n}[getattr(settings, "starts", "median")]
        per_component = 3 * k * d * 4
        chunk = min(n, max(max(h["num_components"] for h in headers), CHUNK_BYTES // per_component))
        total += chunk * per_component + 6 * k * d * 4
        members = k
    elif get_method(method).optimises:
        total += 4 * n * d * 4
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
