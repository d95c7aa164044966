"""The fusion's memory estimate (fusion/resources.py)."""

from __future__ import annotations

from posterior_fusion.fusion.registry import get_method
from posterior_fusion.fusion.resources import READ_OVERHEAD, estimate_fuse_bytes


def test_fuse_memory_estimate_follows_the_fedbens_chunks():
    """fedbens' optimiser memory is one chunk of clients (flat in C) for the median starts, and grows
    with the C·M modes of client starts; a one-mode optimiser keeps every component."""
    def estimate(C, method="fedbens", **kw):
        headers = [{"num_params": 44_190, "num_components": 5, "data_bytes": 0}] * C
        return estimate_fuse_bytes(headers, method, get_method(method).settings(**kw))

    d = 44_190
    assert estimate(40) == estimate(5)  # K = 5 modes: one 64 MiB chunk of clients either way
    # C·M = 200 modes: a component's working set (3·200·d floats, 106 MB) exceeds a chunk, so one client is
    assert estimate(40, starts="clients") == READ_OVERHEAD + 5 * 3 * 200 * d * 4 + 6 * 200 * d * 4 + 2 * 200 * d * 4
    assert estimate(40, "fedfisher") - estimate(5, "fedfisher") == 4 * 175 * d * 4
    # the exact solve keeps float64 vectors of d, whatever C·M: flat in C, far under Adam's
    assert estimate(40, "fedfisher", solver="exact") == estimate(5, "fedfisher", solver="exact")
    assert estimate(40, "hbfl", solver="exact") - estimate(40, "hbfl") == 8 * d * 8 - 4 * 200 * d * 4
