"""One memory budget for every command that reads untrusted files.

Each reader states, from headers alone, how many bytes loading would allocate; the budget
refuses work above its limit before any allocation (``--max-memory`` on every command that
reads artifacts or data files; default 80% of MemAvailable, or ``$PFUSE_MAX_MEMORY``).
"""

from __future__ import annotations

import re

from posterior_fusion.environment import environment
from posterior_fusion.errors import ConfigError, ResourceLimitError


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


def default_limit() -> int | None:
    """``$PFUSE_MAX_MEMORY`` if set, else 80% of MemAvailable (None where unknown)."""
    env = environment("PFUSE_MAX_MEMORY")
    if env:
        return parse_bytes(env)
    avail = available_memory()
    return None if avail is None else int(avail * 0.8)


def resolve_limit(max_memory: int | str | None) -> int | None:
    """An explicit limit (bytes or a size string), else :func:`default_limit`."""
    if max_memory is None:
        return default_limit()
    return parse_bytes(max_memory) if isinstance(max_memory, str) else int(max_memory)


def require(need: int, what: str, max_memory: int | str | None = None) -> None:
    """Refuse ``what`` when its estimated ``need`` (bytes) exceeds the limit."""
    limit = resolve_limit(max_memory)
    if limit is not None and need > limit:
        raise ResourceLimitError(f"{what} needs about {_size(need)}, over the limit of {_size(limit)} "
                                 "(`max_memory`, default 80% of available memory)")


def require_device(need: int, what: str, free: int) -> None:
    """Refuse ``what`` when its estimated GPU working set ``need`` (bytes) exceeds 90% of the GPU
    memory that is ``free`` now (``torch.cuda.mem_get_info``)."""
    if need > 0.9 * free:
        raise ResourceLimitError(f"{what} needs about {_size(need)} of GPU memory, over 90% of the "
                                 f"{_size(free)} free on the GPU now (`device` cpu runs it in host memory)")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**30:.3g} GiB"  # 0.00781 GiB, never "0.01 over 0.01"
