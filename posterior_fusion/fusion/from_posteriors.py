"""Fuse already-loaded client posteriors with one registered method."""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, fields, replace
from typing import Any

import torch

from posterior_fusion.artifact import ClientPosterior, write_global_artifact
from posterior_fusion.data.silo import SiloData
from posterior_fusion.fusion.compatibility import check_compatible
from posterior_fusion.fusion.registry import get_method
from posterior_fusion.fusion.robust import screen_clients
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionOptions, FusionResult
from posterior_fusion.layout import ParameterLayout

FAR_FACTOR = 100.0  # a fused member this many times farther from the prior centre than every client MAP warns


def method_settings(method: str, settings: MethodSettings | Mapping[str, Any] | None = None) -> MethodSettings:
    """The method's settings record: given, built from ``key -> value`` overrides, or its defaults."""
    entry = get_method(method)
    if isinstance(settings, MethodSettings):
        if not isinstance(settings, entry.settings):
            raise TypeError(f"method {method!r} takes {entry.settings.__name__}, got {type(settings).__name__}")
        settings.validate()
        return settings
    return entry.settings.from_mapping(dict(settings or {}), method)


def write_fused(path: str | os.PathLike, inputs: FusionInputs, result: FusionResult, metadata: dict) -> None:
    """Write the global artifact of a fusion (members, and their Laplace curvature when the method made one)."""
    spec = result.model_spec(inputs)
    layout = inputs.clients[0].layout if result.spec is None else ParameterLayout.from_model(spec.build())
    write_global_artifact(path, spec, layout, metadata, result.members, result.curvatures)


def applicable_settings(method: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of ``values`` that are settings of ``method`` (grids that set ``steps`` for
    every method apply it where it means something)."""
    names = {row["name"] for row in get_method(method).settings.describe()}
    return {k: v for k, v in values.items() if k in names}


def fuse_clients(clients: list[ClientPosterior], method: str, options: FusionOptions | None = None,
                 settings: MethodSettings | Mapping[str, Any] | None = None, val: SiloData | None = None,
                 unlabeled: SiloData | None = None, log=lambda msg: None,
                 robust: bool = False, reload=None) -> tuple[FusionInputs, FusionResult, dict]:
    """Run ``method`` on loaded ``clients``; returns ``(inputs, result, metadata)``. ``reload``: the clients came
    without their curvature and the method folds them one at a time (:attr:`FusionInputs.reload`).

    ``metadata`` holds the method, the shared options and the method's settings, the history,
    the screening report and the provenance (path and sha256 of each client artifact).
    """
    entry = get_method(method)
    options = options or FusionOptions()
    options.validate()
    chosen = method_settings(method, settings)
    check_compatible(clients, options.allow_mixed_privacy)
    screening = None
    if robust and "robust" in {f.name for f in fields(chosen)}:  # a method that resists bad clients itself
        chosen = replace(chosen, robust=True)
    if robust:
        probe = FusionInputs(clients, options)
        clients, screening = screen_clients(clients, temperature=probe.temperature,
                                            prior_precision=probe.prior_precision, val=val)
        for row in screening:
            if row["excluded"]:
                log(f"robust: excluding {row['file']}: {'; '.join(row['reasons'])}")
        check_compatible(clients, options.allow_mixed_privacy)
    entry.check_needs(clients, unlabeled)
    inputs = FusionInputs(clients, options, val, unlabeled, reload)
    log(f"fusing {len(clients)} clients with {method} ({clients[0].structure}, M={clients[0].num_components})")
    t0 = time.perf_counter()
    result = entry(inputs, chosen)
    seconds = time.perf_counter() - t0
    private = [c.path for c in clients if isinstance(c.metadata.get("dp"), dict)]
    if private and len(private) < len(clients):
        log(f"fusing {len(private)} differentially private and {len(clients) - len(private)} non-private clients "
            "(`allow_mixed_privacy`): the global carries no guarantee for the non-private clients' data")
    metadata = {
        **({"mixed_privacy": {"private": private, "not_private": [c.path for c in clients if c.path not in private]}}
           if private and len(private) < len(clients) else {}),
        "method": method, "options": asdict(options), "settings": asdict(chosen), "fuse_seconds": round(seconds, 3),
        "temperature_used": [inputs.temperature(c) for c in clients],
        "prior_precision_used": [inputs.prior_precision(c) for c in clients],
        "server_prior_precision": inputs.server_prior_precision(),
        "structure": clients[0].structure, "screening": screening,
        "input_transform": clients[0].metadata.get("input_transform"),
        "provenance": [{"file": c.path, "sha256": c.sha256, "n_data": c.n_data,
                        **({"dp": {k: c.metadata["dp"][k] for k in ("epsilon", "delta")}}
                           if isinstance(c.metadata.get("dp"), dict) else {}),
                        **({"refresh_dp": {k: c.metadata["refreshed_at"]["dp"][k] for k in ("epsilon", "delta")}}
                           if isinstance((c.metadata.get("refreshed_at") or {}).get("dp"), dict) else {})}
                       for c in clients],
        "base_sha256": (clients[0].metadata.get("init") or {}).get("base_sha256")
        if isinstance(clients[0].metadata.get("init"), dict) else None,
        **({"class_names": names} if (names := next((list(c.metadata["class_names"]) for c in clients
                                                      if c.metadata.get("class_names")), None)) else {}),
        "validation": None if val is None else {"sha256": val.sha256(), "n": len(val)},
        **dict(result.info.items()),
    }
    far = far_members(inputs, result)
    if far is not None:
        metadata["far_members"] = far
    return inputs, result, metadata


def far_members(inputs: FusionInputs, result: FusionResult) -> dict | None:
    """One warning, and its record, when a fused member lies more than :data:`FAR_FACTOR` times farther from the
    clients' prior centre (the base they fine-tuned, or zero) than the farthest client MAP: no product of the
    clients' posteriors supports such a network, and its logits overflow float32 on real inputs (a diverged
    fusion). The distances are Euclidean over the posterior's parameters; ``None`` when every member is near."""
    centre = inputs.prior_mean()
    origin = 0.0 if centre is None else centre

    def distance(w: torch.Tensor) -> float:
        return float((w.double() - origin).norm())

    reach = max(distance(comp.map) for c in inputs.clients for comp in c.components)
    if reach == 0.0:
        return None
    ratios = [distance(w) / reach for w in result.members]
    ratios = [math.inf if math.isnan(r) else r for r in ratios]  # a NaN member is as far as can be
    far = [k for k, r in enumerate(ratios) if r > FAR_FACTOR]
    if not far:
        return None
    where = "the base the clients fine-tuned" if centre is not None else "zero, the clients' prior centre"
    k = max(far, key=ratios.__getitem__)
    warnings.warn(f"fused member {k} (of {len(ratios)}) lies {ratios[k]:.3g} times farther from {where} than the "
                  f"farthest client MAP ({ratios[k] * reach:.4g} against {reach:.4g}): the fusion diverged, and its "
                  "predictions are likely to overflow (evaluate and predict refuse a non-finite predictive) — "
                  "fuse with another method or setting", stacklevel=3)
    return {"members": far, "ratio": [ratios[i] for i in far], "client_reach": reach, "factor": FAR_FACTOR}
