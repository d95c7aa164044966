"""Memory estimate for ``fuse``, computed from artifact and data headers before any data is loaded.
Each method declares its own part (:class:`~posterior_fusion.fusion.method_type.FusionMethod`'s
``members`` and ``work_bytes``); this module adds what every fusion holds."""

from __future__ import annotations

from posterior_fusion.fusion.method_type import FuseSize
from posterior_fusion.fusion.registry import get_method
from posterior_fusion.fusion.settings_parsing import MethodSettings

READ_OVERHEAD = 32 * 2**20  # what reading and validating the files costs beyond their tensors (HDF5 buffers, copies)


def estimate_fuse_bytes(headers: list[dict], method: str, settings: MethodSettings, data_bytes: int = 0,
                        data_rows: int = 0, keep_curvature: bool = True, folded: bool = False) -> int:
    """Peak-memory estimate of a fusion from ``declared_bytes`` of each client artifact and
    the declared size of the server's data files (``data_bytes``, ``data_rows`` samples).

    Loaded tensors (1x) + eigendecompositions and stacked float32 copies (2x); the dense factors of
    compressed Kronecker blocks (``dense_bytes`` − ``data_bytes``) times the method's ``dense_copies``; its own
    working set; its members (twice: the result and its copy); data files converted to float32
    (4 bytes per stored byte at most) and their logits per member; :data:`READ_OVERHEAD` on top
    (``benchmarks/compact_memory.py``: 6–16 MiB above the start-up for methods that hold nothing else).
    ``keep_curvature`` False (a fusion that reads none: :func:`~posterior_fusion.fusion.from_files.keeps_curvature`):
    the artifacts without their curvature, and one block at a time (twice: read and decoded) while each is checked;
    ``folded`` (:func:`~posterior_fusion.fusion.from_files.folds_clients`): also the largest client's curvature, 3x.
    """
    entry = get_method(method)
    size = FuseSize(headers[0]["num_params"], len(headers), max(h["num_components"] for h in headers))
    num_classes = max(h.get("num_classes", 1) for h in headers)
    members = entry.members(settings, size)
    if keep_curvature:
        total = READ_OVERHEAD + 3 * sum(h["data_bytes"] for h in headers)
        total += entry.dense_copies * sum(h.get("dense_bytes", h["data_bytes"]) - h["data_bytes"] for h in headers)
    else:
        total = READ_OVERHEAD + 3 * sum(h["data_bytes"] - h["curvature_bytes"] for h in headers)
        total += 2 * max(h["largest_block_bytes"] for h in headers)
        if folded:
            total += 3 * max(h["curvature_bytes"] for h in headers)
    total += entry.work_bytes(settings, size)
    total += 2 * members * size.d * 4
    total += 4 * data_bytes + members * data_rows * num_classes * 4
    return int(total)


def estimate_device_bytes(headers: list[dict], method: str, settings: MethodSettings) -> int:
    """The GPU's working set of a fusion on ``device="cuda"``: the stacked float32 copies of every
    client's curvature and MAPs and their eigendecompositions (2x the artifacts' tensors), the
    method's own working set and its members (the data and the results stay on the CPU)."""
    entry = get_method(method)
    size = FuseSize(headers[0]["num_params"], len(headers), max(h["num_components"] for h in headers))
    dense = entry.dense_copies * sum(h.get("dense_bytes", h["data_bytes"]) - h["data_bytes"] for h in headers)
    return int(2 * sum(h["data_bytes"] for h in headers) + dense + entry.work_bytes(settings, size)
               + entry.members(settings, size) * size.d * 4)
