"""Curvature capture: the raw GGN of a trained model summed over the silo's data, as a
:class:`~posterior_fusion.curvature.BlockDiag` (no prior, no temperature).

The package is split by what it computes: :mod:`.policy` (which block each parameter gets, the
capture's options), :mod:`.inputs` and :mod:`.outputs` (K-FAC's input and output factors),
:mod:`.gram` (the float64 Gram every factor uses), :mod:`.sizing` (samples per pass), :mod:`.fast`
(the capture itself) and :mod:`.laplace` (laplace-torch, the oracle and an option). The layer
passes it shares with the predictive live in :mod:`posterior_fusion.models.jacobians`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from posterior_fusion.choices import CAPTURE_METHODS, GGN_TYPES, KFAC_TYPES, STRUCTURES
from posterior_fusion.curvature import BlockDiag
from posterior_fusion.errors import CaptureNotApplicableError, ConfigError
from posterior_fusion.local.capture.fast import FAST_CAPTURE
from posterior_fusion.local.capture.laplace import LAPLACE_CAPTURE
from posterior_fusion.local.capture.policy import AUTOCAST_DTYPES
from posterior_fusion.local.fit_config import capture_dtype_problem
from posterior_fusion.models.layers import unsupported_reason

__all__ = ["capture", "capture_dtype_problem"]


def capture(structure: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256,
            ggn: str = "exact", method: str = "fast", generator: torch.Generator | None = None,
            log=lambda m: None, kfac: str = "expand", capture_dtype: str = "float32") -> tuple[BlockDiag, str]:
    """Raw curvature of ``structure`` and the method that computed it (``"fast"`` or ``"laplace"``).

    ``ggn="exact"``: exact GGN (one backward pass per class); ``"mc"``: Monte-Carlo Fisher with
    one sampled label (``generator`` draws it on the fast path). ``method="fast"`` uses
    :mod:`.fast` and refuses, in one line, a model it cannot take (never a silent fall-back to laplace-torch,
    which only ``method="laplace"`` uses); the last-layer full block of ``diag+full`` is always exact on the fast path
    (closed form, cheaper than sampling). ``kfac`` ("expand" or "reduce") applies to ``kron``.
    ``capture_dtype`` "bfloat16": the fast capture's forward and backward passes under bfloat16
    autocast (the factors still summed in float64 from those vectors); refused where the fast
    capture is not used (:func:`capture_dtype_problem`)."""
    if structure not in STRUCTURES:
        raise ConfigError(f"unknown curvature structure {structure!r}; use one of {', '.join(STRUCTURES)}")
    if method not in CAPTURE_METHODS:
        raise ConfigError(f"unknown capture method {method!r}; use one of {', '.join(CAPTURE_METHODS)}")
    if ggn not in GGN_TYPES:
        raise ConfigError(f"unknown GGN type {ggn!r}; use one of {', '.join(GGN_TYPES)}")
    if kfac not in KFAC_TYPES:
        raise ConfigError(f"unknown K-FAC type `kfac` {kfac!r}; use one of {', '.join(KFAC_TYPES)}")
    reason = unsupported_reason(model, x[:2]) if method == "fast" else None
    problem = capture_dtype_problem(capture_dtype, method, reason)
    if problem is not None:
        raise ConfigError(problem)
    extra = {"kfac": kfac} if structure == "kron" else {}
    if AUTOCAST_DTYPES[capture_dtype] is not None:
        extra["compute_dtype"] = AUTOCAST_DTYPES[capture_dtype]
    if method == "fast":
        if reason is None:
            return FAST_CAPTURE[structure](model, x, y, batch_size, ggn, generator, **extra), "fast"
        raise CaptureNotApplicableError(f"the fast capture cannot take this model ({reason}); `capture` laplace "
                                        "computes the curvature with laplace-torch (an optional install) where it "
                                        "supports the layers — or use the layers of docs/methods.md's layer policy")
    if x.device.type != "cpu":
        model, x, y = copy.deepcopy(model).cpu(), x.cpu(), y.cpu()  # laplace-torch's backends run here on the CPU
    return LAPLACE_CAPTURE[structure](model, x, y, batch_size, ggn, **extra), "laplace"
