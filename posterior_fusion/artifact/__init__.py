"""HDF5 artifacts: schema, atomic writer, validating reader, typed objects.

The public names load on first use (PEP 562), so the torch-free parts (``schema``,
``jsonattr``, ``h5check``, ``preview``) can be imported without importing torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ClientPosterior": "objects", "Component": "objects", "GlobalEnsemble": "objects", "SwagMoments": "objects",
    "build_model": "objects", "file_sha256": "reader", "load": "reader", "load_client": "reader",
    "load_global": "reader", "write_client_artifact": "writer", "write_global_artifact": "writer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
