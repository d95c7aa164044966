"""Memory estimate for ``fuse``, computed from artifact headers before any data is loaded."""

from __future__ import annotations

import os
import re

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.registry import get_method


def parse_bytes(text: str) -> int:
    """'512M', '8G', '1.5GiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        raise ConfigError(f"cannot read a memory size from {text!r} (use e.g. 512M, 8G)")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimate_fuse_bytes(headers: list[dict], method: str, modes: int | None) -> int:
    """Peak-memory estimate of a fusion from ``declared_bytes`` of each client.

    Loaded tensors (1x) + eigendecompositions and stacked float32 copies (2x) for the
    curvature methods; the optimisers also hold K x N rotated copies of the parameter vector
    with their autograd buffers (about 4 of them).
    """
    data = sum(h["data_bytes"] for h in headers)
    total = data * 3
    if get_method(method).optimises:
        d = headers[0]["num_params"]
        n = sum(h["num_components"] for h in headers)
        k = (modes or headers[0]["num_components"]) if method == "fedbens" else 1
        total += 4 * k * n * d * 4
    return int(total)


def default_limit() -> int | None:
    avail = available_memory()
    env = os.environ.get("PFUSE_MAX_MEMORY")
    if env:
        return parse_bytes(env)
    return None if avail is None else int(avail * 0.8)
