"""posterior-fusion: one-shot federated learning by Bayesian posterior fusion.

``posterior_fusion.load(path)`` validates an artifact and returns typed objects. Attributes
are imported on first use (PEP 562), so ``import posterior_fusion`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_LAZY = {
    "load": "posterior_fusion.artifact", "ClientPosterior": "posterior_fusion.artifact",
    "Component": "posterior_fusion.artifact", "GlobalEnsemble": "posterior_fusion.artifact",
    "Precision": "posterior_fusion.curvature", "Diag": "posterior_fusion.curvature",
    "Dense": "posterior_fusion.curvature", "Kron": "posterior_fusion.curvature",
    "BlockDiag": "posterior_fusion.curvature", "PfuseError": "posterior_fusion.errors",
    "ParameterLayout": "posterior_fusion.layout", "ModelSpec": "posterior_fusion.models",
    "read_data": "posterior_fusion.data.silo", "GaussianMixture": "posterior_fusion.mixture",
    "write_base": "posterior_fusion.local.init",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in ("artifact", "curvature", "errors", "layout", "models", "fusion", "data", "local", "kernels",
                "metrics", "predictive", "experiment", "flower", "budget", "hdf5_safety", "summary", "demo", "files",
                "ranges", "runtime"):
        return importlib.import_module(f"posterior_fusion.{name}")
    raise AttributeError(f"module 'posterior_fusion' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API (the lazy attributes included), as ``dir(posterior_fusion)`` and completion show it."""
    return sorted({*globals(), *__all__})
