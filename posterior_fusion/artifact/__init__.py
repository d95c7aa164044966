"""HDF5 artifacts, file I/O only: schema, writer, validating reader (the typed posteriors they
return live in :mod:`posterior_fusion.posterior`, re-exported here).

The public names load on first use (PEP 562), so the torch-free parts (``schema``,
``jsonattr``, ``h5check``, ``preview``) can be imported without importing torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ClientPosterior": "posterior_fusion.posterior", "Component": "posterior_fusion.posterior",
    "GlobalEnsemble": "posterior_fusion.posterior", "SwagMoments": "posterior_fusion.posterior",
    "build_model": "posterior_fusion.posterior", "file_sha256": "reader", "load": "reader", "load_client": "reader",
    "load_global": "reader", "write_client_artifact": "writer", "write_global_artifact": "writer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _WHERE[name]
    return getattr(importlib.import_module(where if "." in where else f"{__name__}.{where}"), name)
