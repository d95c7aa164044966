"""Config-driven experiment grids (``pfuse experiment CONFIG.toml``): :mod:`.grid_config` (the
grid's declared keys), :mod:`.grid` (cached levels: partition -> fits -> fusion results), :mod:`.report`
(tables and plots). The public names load on first use (PEP 562), so the config is read without torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"ExperimentConfig": "grid_config", "run_experiment": "grid", "aggregate": "report",
          "write_tables": "report"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
