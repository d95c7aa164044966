"""A member's flat weights ``(d,)`` as a network: built (:func:`build_model`), exported with a complete
``state_dict`` (:func:`exported_state`, :func:`exported_module`), fed its inputs (:func:`model_inputs`, the
artifact's input transform as a module) and its outputs checked (:func:`checked_probabilities`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.utils import vector_to_parameters

from posterior_fusion.data.transform import InputTransform
from posterior_fusion.errors import ConfigError, NonFiniteOutputError, shown
from posterior_fusion.models import ModelSpec


def exported_state(spec: ModelSpec, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of :meth:`ModelSpec.architecture` for a member's flat ``weights`` ``(d,)``: trained and
    frozen weights, LoRA merged, a BatchNorm's statistics (its batch counter the architecture's own)."""
    from posterior_fusion.models.finetune import merged_state

    state = merged_state(build_model(spec, weights))
    with torch.device("meta"):
        wanted = spec.architecture().state_dict()
    missing = [k for k in wanted if k not in state and not k.endswith("num_batches_tracked")]
    if missing:
        raise ConfigError(f"model {spec.name!r}: no exported value for {', '.join(missing[:3])}")
    return {k: (state[k].detach().clone().contiguous() if k in state else torch.zeros((), dtype=torch.long))
            for k in wanted}


def exported_module(spec: ModelSpec, weights: torch.Tensor) -> nn.Module:
    """A fresh :meth:`ModelSpec.architecture` module holding :func:`exported_state`, in evaluation mode."""
    model = spec.architecture()
    model.load_state_dict(exported_state(spec, weights), strict=True)
    return model.eval()


class InputTransformModule(nn.Module):
    """An artifact's input transform as a module (raw data in, the model's inputs out; None: the identity)."""

    def __init__(self, transform: InputTransform | None) -> None:
        super().__init__()
        self.transform = transform

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform is None:
            return x.float()
        return self.transform.apply(x.detach().cpu().numpy(), "inputs").to(x.device)


def build_model(spec: ModelSpec, weights: torch.Tensor) -> nn.Module:
    """A fresh model of ``spec`` with the flat ``weights`` ``(d,)`` copied in (independent storage)."""
    model = spec.build()
    vector_to_parameters(weights.detach().clone().to(torch.float32), model.parameters())
    model.eval()
    return model


def model_inputs(spec: ModelSpec, transform: Mapping[str, Any] | None, x: torch.Tensor | np.ndarray, raw: bool,
                 where: str) -> torch.Tensor:
    """float32 model inputs from ``x`` (numpy or torch, any real dtype): the recorded input
    transform applied unless ``raw``; a shape the model cannot take is refused in one line."""
    if isinstance(x, torch.Tensor) and x.is_meta:
        raise ConfigError(f"{where}: inputs are a meta tensor (a shape without values)")
    try:
        arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{where}: inputs must be a real array (n, ...): {shown(str(exc), 80)}") from None
    if arr.dtype.kind not in "fiub" or arr.ndim < 2:
        raise ConfigError(f"{where}: inputs must be a real array (n, ...), got {arr.dtype} of shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ConfigError(f"{where}: inputs hold no rows (shape {arr.shape})")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        row = int(np.argwhere(~np.isfinite(arr.reshape(arr.shape[0], -1)))[0][0])
        raise ConfigError(f"{where}: inputs hold NaN or Inf (first in row {row})")
    with np.errstate(over="ignore", invalid="ignore"):  # values beyond float32 become Inf: refused just below
        if raw or transform is None:
            out = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        else:
            out = InputTransform.from_dict(dict(transform), where).apply(arr, "inputs")
    if not torch.isfinite(out).all():
        row = int(torch.nonzero(~torch.isfinite(out.reshape(out.shape[0], -1)))[0, 0])
        raise ConfigError(f"{where}: inputs beyond float32's range (first in row {row}, after the input transform)")
    spec.check_input(tuple(out.shape[1:]), f"{where}: inputs")
    spec.check_token_ids(out, f"{where}: inputs")
    return out


def checked_probabilities(probs: torch.Tensor, where: str, metadata: Mapping[str, Any] | None = None) -> torch.Tensor:
    """``probs`` ``(n, classes)`` as they are if every row is finite; else :func:`non_finite_predictive`'s error
    (``metadata``: the global's, which may record a diverged fusion): the API never returns NaN probabilities."""
    bad = ~torch.isfinite(probs).all(dim=-1)
    if bad.any():
        raise non_finite_predictive(where, int(bad.sum()), probs.shape[0], metadata)
    return probs


def non_finite_predictive(where: str, count: int, n: int,
                          metadata: Mapping[str, Any] | None = None) -> NonFiniteOutputError:
    """The one error for a predictive that is not finite on ``count`` of ``n`` input rows: a global whose fusion
    warned that its members lie far from every client MAP (metadata ``far_members``) is a diverged fusion;
    otherwise the inputs are far outside what the models were trained on (their logits overflow)."""
    why = ("a diverged fusion: its members lie far from every client MAP (metadata far_members)"
           if (metadata or {}).get("far_members") else
           "the inputs are far outside what the models were trained on (the logits overflow float32)")
    return NonFiniteOutputError(f"{where}: the predictive is not finite for {count} of {n} input rows: {why}")
