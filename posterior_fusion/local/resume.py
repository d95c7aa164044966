"""Crash-safe fitting: a partial artifact after each component, resumed only with the same
fingerprint (settings, data, starting points)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from posterior_fusion.artifact import load_client
from posterior_fusion.errors import ResumeError
from posterior_fusion.posterior import Component


def partial_path(out: str | os.PathLike) -> Path:
    """``.<name>.partial.h5`` beside ``out``."""
    p = Path(out)
    return p.with_name(f".{p.name}.partial.h5")


def resume_state(out: str | os.PathLike, fingerprint: str, num_components: int, resume: bool,
                 log: Callable[[str], None]) -> list[Component]:
    """Components finished by an interrupted run of the same fit (if ``resume``), else ``[]``."""
    partial = partial_path(out)
    if not partial.exists():
        if resume:
            log(f"note: no partial run at {partial}; starting from the first component")
        return []
    if not resume:
        log(f"note: discarding the partial run at {partial} (pass --resume to continue it)")
        return []
    previous = load_client(partial)
    if previous.metadata.get("fit_fingerprint") != fingerprint:
        raise ResumeError(f"{partial}: the partial run used different settings, data or inits; "
                          "rerun with the same options or delete it")
    log(f"resuming: {previous.num_components} of {num_components} components already done")
    return list(previous.components)
