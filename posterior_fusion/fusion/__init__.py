"""Fusion methods (one module each, registered in :mod:`.registry`) and the server entry points.

``fuse(paths, method, options, settings)`` works on files; ``fuse_clients`` on loaded
posteriors. Shared options are :class:`FusionOptions`; each method's own hyper-parameters
are its settings record (``METHODS[name].settings``).

The public names load on first use (PEP 562): the registry's names and the settings parser
(:mod:`.settings_parsing`) are read without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "fuse": "from_files", "applicable_settings": "from_posteriors", "fuse_clients": "from_posteriors",
    "method_settings": "from_posteriors", "write_fused": "from_posteriors", "METHODS": "registry",
    "get_method": "registry", "FusionInputs": "types", "FusionMethod": "method_type", "FusionOptions": "options",
    "FusionResult": "types",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
