"""The server's entry point on files: validate every client artifact, budget memory, fuse."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

from posterior_fusion import budget
from posterior_fusion.artifact import load_client
from posterior_fusion.artifact.reader import declared_bytes
from posterior_fusion.data.silo import read_silo, silo_header
from posterior_fusion.data.transform import check_transform
from posterior_fusion.errors import ConfigError, IncompatibleArtifactsError, SchemaError
from posterior_fusion.fusion.batchnorm_statistics import check_batchnorm_statistics, reset_members
from posterior_fusion.fusion.distill import DistillConfig, distill_members
from posterior_fusion.fusion.from_posteriors import fuse_clients, method_settings
from posterior_fusion.fusion.registry import get_method, resolve_default
from posterior_fusion.fusion.resources import estimate_device_bytes, estimate_fuse_bytes
from posterior_fusion.fusion.robust import screen_clients
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.fusion.synthesis import synthetic_input_shape
from posterior_fusion.fusion.teaching import (
    TeachingConfig,
    check_view_cache,
    student_spec,
    teach_members,
)
from posterior_fusion.fusion.tuning import tune_fusion
from posterior_fusion.fusion.types import FusionInputs, FusionOptions, FusionResult
from posterior_fusion.metrics import evaluate_members


def plan_fusion(client_paths: list[str | os.PathLike], method: str | None,
                settings: MethodSettings | Mapping[str, Any] | None = None, val_path: str | os.PathLike | None = None,
                unlabeled_path: str | os.PathLike | None = None, max_memory: int | str | None = None,
                robust: bool = False, tune: tuple[str, ...] = (),
                distill: DistillConfig | TeachingConfig | None = None) -> dict:
    """What :func:`fuse` will hold, from the headers alone (each client's header validated, no value read); refused in
    one line where the estimate exceeds ``max_memory``. ``fuse --dry-run`` prints it.

    Args:
        client_paths: the clients' artifacts.
        method: as :func:`fuse` takes it (None: the default).
        settings: as :func:`fuse` takes them.
        val_path: labelled server data, as :func:`fuse` takes it.
        unlabeled_path: unlabeled server inputs, as :func:`fuse` takes them.
        max_memory: the memory limit, bytes or a size [default: 80% of available memory].
        robust: as :func:`fuse` takes it (it keeps the curvature).
        tune: as :func:`fuse` takes it (it keeps the curvature).
        distill: as :func:`fuse` takes it (data-free teaching keeps the curvature).

    Returns:
        ``{method, clients, artifact_bytes (on disk), data_bytes (the clients' datasets once loaded),
        curvature_kept (:func:`keeps_curvature`), curvature_folded (:func:`folds_clients`), memory_estimate_bytes (the whole fusion's working set, server data
        included), memory_limit_bytes}``.
    """
    if method is None:
        method, settings = resolve_default(None, None if isinstance(settings, MethodSettings) else settings)
    chosen = method_settings(method, settings)
    keep, folded = _curvature_reading(method, chosen, robust, tune, distill, unlabeled_path)
    return _plan(client_paths, method, chosen, val_path, unlabeled_path, max_memory, keep, folded)[0]


def keeps_curvature(method: str, chosen: MethodSettings, robust: bool = False, tune: tuple[str, ...] = (),
                    distill: DistillConfig | TeachingConfig | None = None,
                    unlabeled_path: str | os.PathLike | None = None) -> bool:
    """Whether a fusion holds the clients' curvature: the method reads it with these settings
    (:attr:`~posterior_fusion.fusion.method_type.FusionMethod.uses_curvature`), or ``robust`` screening, ``tune`` or
    data-free teaching (the first layer's recorded input factor) does. Where not, each curvature block is read
    and checked, then dropped."""
    data_free = isinstance(distill, TeachingConfig) and not unlabeled_path
    return get_method(method).uses_curvature(chosen) or robust or bool(tune) or data_free


def folds_clients(method: str, chosen: MethodSettings, robust: bool = False, tune: tuple[str, ...] = ()) -> bool:
    """Whether a fusion reads the clients' curvature one client at a time instead of holding it: a method whose
    server step is a sum over clients of any structure (fedavg, fisher-merge:
    :class:`~posterior_fusion.fusion.client_sums.ClientSums`), with neither ``robust`` screening nor ``tune``
    (which compare the clients). Each client is then loaded twice: without its curvature with the others, and with
    it for its term of the sum."""
    sums = get_method(method).sums
    return sums is not None and sums.structures is None and not robust and not tune


def _curvature_reading(method, chosen, robust, tune, distill, unlabeled_path) -> tuple[bool, bool]:
    """``(keep, folded)``: whether the clients are held with their curvature, or read again one at a time."""
    keep = keeps_curvature(method, chosen, robust, tune, distill, unlabeled_path)
    folded = keep and folds_clients(method, chosen, robust, tune)
    return keep and not folded, folded


def _plan(client_paths, method: str, chosen: MethodSettings, val_path, unlabeled_path,
          max_memory, keep_curvature: bool = True, folded: bool = False) -> tuple[dict, list[dict]]:
    """:func:`plan_fusion`'s record and the clients' validated headers."""
    headers = [declared_bytes(p) for p in client_paths]
    for p, h in zip(client_paths, headers):
        if h["kind"] != "client":
            raise SchemaError(str(p), "expected a client artifact (from fit-local), got a global one", "/")
    data = [silo_header(p) for p in (val_path, unlabeled_path) if p]
    need = estimate_fuse_bytes(headers, method, chosen, sum(h.load_bytes for h in data), sum(h.n for h in data),
                               keep_curvature, folded)
    budget.require(need, f"fusing these {len(headers)} artifacts with {method}", max_memory)
    return {"method": method, "clients": len(headers), "artifact_bytes": sum(os.path.getsize(p) for p in client_paths),
            "data_bytes": sum(h["data_bytes"] for h in headers), "curvature_kept": keep_curvature,
            "curvature_folded": folded,
            "memory_estimate_bytes": need,
            "memory_limit_bytes": budget.resolve_limit(max_memory)}, headers


def fuse(client_paths: list[str | os.PathLike], method: str | None, options: FusionOptions | None = None,
         settings: MethodSettings | Mapping[str, Any] | None = None,
         val_path: str | os.PathLike | None = None, unlabeled_path: str | os.PathLike | None = None,
         log=lambda msg: None, robust: bool = False, max_memory: int | str | None = None,
         tune: tuple[str, ...] = (), tune_temperatures=None, tune_prior_vars=None,
         distill: DistillConfig | TeachingConfig | None = None,
         distill_checkpoint: str | os.PathLike | None = None,
         ) -> tuple[FusionInputs, FusionResult, dict]:
    """Validate every client artifact, run ``method`` and return what it fused.

    Headers are checked and the memory need estimated first (refused above ``max_memory``); then the artifacts are
    loaded (without their curvature where nothing reads it: :func:`keeps_curvature`) and fused.

    Args:
        client_paths: the clients' artifacts (from ``fit-local``).
        method: a registry name (:data:`~posterior_fusion.fusion.registry.METHODS`), or None for the default
            (:data:`~posterior_fusion.fusion.registry.DEFAULT_METHOD` with its
            :data:`~posterior_fusion.fusion.registry.DEFAULT_SETTINGS`).
        options: the settings every method shares (T, σ0², device, kernel, …) [default: their defaults].
        settings: the method's settings record, or ``name -> value`` overrides of its defaults.
        val_path: labelled server validation data (selection, calibration check).
        unlabeled_path: unlabeled server inputs (FedBE, FedPPD's distillation, ``distill``).
        log: called with each progress line.
        robust: screen out outlying clients first (:mod:`posterior_fusion.fusion.robust`).
        max_memory: the memory limit, bytes or a size [default: 80% of available memory].
        tune: ``"T"`` and/or ``"prior"``: choose T / σ0² on the validation data over a grid
            (:mod:`posterior_fusion.fusion.tuning`), over ``tune_temperatures`` / ``tune_prior_vars``.
        tune_temperatures: the grid of T for ``tune``.
        tune_prior_vars: the grid of σ0² for ``tune``.
        distill: distil the fused members into one network — :class:`DistillConfig`, FedBE's recipe on the unlabeled
            data (:mod:`posterior_fusion.fusion.distill`), or :class:`TeachingConfig`, consistent teaching on the
            unlabeled data or, without any, on inputs synthesised from the artifacts
            (:mod:`posterior_fusion.fusion.teaching`).
        distill_checkpoint: where teaching keeps its state, and from which an interrupted one resumes
            (:mod:`posterior_fusion.fusion.teaching_checkpoint`).

    Returns:
        ``(inputs, result, metadata)``: the validated clients (:class:`FusionInputs`), the members ``(d,)`` each with
        their weights and curvature where the method made them (:class:`FusionResult`), and the global artifact's
        metadata.
    """
    options = options or FusionOptions()
    options.validate()
    if method is None:  # the registry's default method with its default settings under those given
        method, settings = resolve_default(None, None if isinstance(settings, MethodSettings) else settings)
    chosen = method_settings(method, settings)
    if distill is not None:
        distill.validate()
        if not unlabeled_path and not isinstance(distill, TeachingConfig):
            raise ConfigError("`distill` needs unlabeled server data (`unlabeled` FILE)")
    if not client_paths:
        raise IncompatibleArtifactsError("no client artifacts given")
    get_method(method).check_needs(unlabeled=unlabeled_path)  # the data a method needs, before anything is read
    if options.batchnorm_statistics == "reset" and not (unlabeled_path or val_path):
        raise ConfigError("`batchnorm_statistics` reset estimates the fused model's BatchNorm statistics on server "
                          "inputs: give `unlabeled` (or `val`) data")
    keep, folded = _curvature_reading(method, chosen, robust, tune, distill, unlabeled_path)
    plan, headers = _plan(client_paths, method, chosen, val_path, unlabeled_path, max_memory, keep, folded)
    need = plan["memory_estimate_bytes"]
    if options.device == "cuda":  # the GPU's own working set, against what is free on it now
        import torch

        budget.require_device(estimate_device_bytes(headers, method, chosen),
                              f"fusing these {len(headers)} artifacts with {method} on the GPU",
                              torch.cuda.mem_get_info()[0])
    clients = [load_client(p, max_memory, keep) for p in client_paths]
    if options.batchnorm_statistics == "reset":
        check_batchnorm_statistics(FusionInputs(clients, options))
    k = clients[0].model_spec.num_classes
    val = read_silo(val_path, num_classes=k, max_memory=max_memory) if val_path else None
    unlabeled = (read_silo(unlabeled_path, num_classes=k, max_memory=max_memory, labels=False)
                 if unlabeled_path else None)
    student = None  # the student's model and its cached views: refused before any fusion where they do not fit
    if isinstance(distill, TeachingConfig) and (distill.student or distill.views):
        shape = unlabeled.input_shape() if unlabeled is not None else synthetic_input_shape(distill, clients)
        student = student_spec(distill, clients[0].model_spec, shape) if distill.student else None
        check_view_cache(distill, len(unlabeled) if unlabeled is not None else distill.synth_size, math.prod(shape),
                         k, max_memory)
    for data in (val, unlabeled):
        if data is not None:
            check_transform(clients[0].metadata.get("input_transform"), data.input_transform, data.source,
                            clients[0].path)
            clients[0].model_spec.check_input(data.input_shape(), data.source)
            clients[0].model_spec.check_token_ids(data.x, data.source)
    if tune:
        if robust:
            probe = FusionInputs(clients, options)
            clients, _ = screen_clients(clients, temperature=probe.temperature,
                                        prior_precision=probe.prior_precision, val=val)
        grids = {k: v for k, v in (("temperatures", tune_temperatures), ("prior_vars", tune_prior_vars)) if v}
        inputs, result, metadata = tune_fusion(clients, method, options, val, tune, log=log, settings=chosen, **grids)
    else:
        reload = (lambda c: _with_curvature(c, max_memory)) if folded else None
        inputs, result, metadata = fuse_clients(clients, method, options, chosen, val, unlabeled, log, robust, reload)
    if options.batchnorm_statistics == "reset":  # before any distillation: the teachers with their statistics
        server = unlabeled if unlabeled is not None else val
        metadata["batchnorm_statistics"] = {**reset_members(inputs, result, server.inputs(), log),
                                            "file": str(unlabeled_path or val_path), "sha256": server.sha256()}
    elif any(c.metadata.get("batchnorm") == "fold" for c in inputs.clients):
        metadata["batchnorm_statistics"] = {"rule": "fold"}
    if isinstance(distill, TeachingConfig) and not get_method(method).distils:
        log(f"teaching one network what {len(result.members)} members predict "
            + (f"on {len(unlabeled)} unlabeled inputs" if unlabeled is not None else "without server inputs"))
        w, record = teach_members(inputs.spec, list(result.members), None if unlabeled is None else unlabeled.inputs(),
                                  distill, result.pooling(inputs.spec.num_classes), result.mode_weights,
                                  inputs.clients, options.progress, log, distill_checkpoint, student, max_memory)
        teachers, result = result, result.distilled(w, record, student)
        metadata = {**{k: v for k, v in metadata.items() if k not in teachers.info}, **result.info}
        metadata["distill"] = {**record, **({"file": str(unlabeled_path), "sha256": unlabeled.sha256()}
                                           if unlabeled is not None else {"file": None})}
    elif distill is not None and not get_method(method).distils:  # a distilling method does it with this schedule
        log(f"distilling {len(result.members)} members into one model on {len(unlabeled)} unlabeled inputs")
        w, record = distill_members(inputs.spec, result.members, unlabeled.inputs(), distill,
                                    options.sampling_seed, options.progress, result.mode_weights,
                                    result.pooling(inputs.spec.num_classes))
        teachers, result = result, result.distilled(w, record)
        # the method's own fields follow the result: those that described the teachers leave with them
        metadata = {**{k: v for k, v in metadata.items() if k not in teachers.info}, **result.info}
        metadata["distill"] = {**record, "file": str(unlabeled_path), "sha256": unlabeled.sha256()}
    metadata["memory_estimate_bytes"] = need
    if val is not None:
        metadata["validation"] = {"file": str(val_path), "sha256": val.sha256(), "n": len(val)}
        check_calibration(inputs, result, val, get_method(method).tunable, max_memory)
    return inputs, result, metadata


def _with_curvature(client, max_memory):
    """``client`` read again from its file with its curvature; refused in one line if the file changed since."""
    again = load_client(client.path, max_memory)
    if again.sha256 != client.sha256:
        raise IncompatibleArtifactsError(f"{client.path}: changed while it was being fused (its SHA-256 differs)")
    return again


MISCALIBRATED_ECE = 0.15  # a fused ensemble this far from calibrated on the validation data warns


def check_calibration(inputs: FusionInputs, result, val, tunable: bool, max_memory=None) -> None:
    """One warning when the fused ensemble's validation ECE is at least :data:`MISCALIBRATED_ECE`: which
    way it errs (its mean confidence against its accuracy) and what helps — for a method whose fit
    depends on T and σ0² (``tunable``), choosing them on the validation data; else the default fusion."""
    m = evaluate_members(result.model_spec(inputs), result.members, val, max_memory=max_memory,
                         weights=result.mode_weights, pooling=result.pooling(inputs.spec.num_classes))
    if m["ece"] < MISCALIBRATED_ECE:
        return
    filled = [r for r in m["reliability"] if r["count"]]
    confidence = sum(r["confidence"] * r["count"] for r in filled) / max(1, sum(r["count"] for r in filled))
    side = "underconfident" if confidence < m["accuracy"] else "overconfident"
    warnings.warn(f"the fused model is {side} on the validation data (ECE {m['ece']:.2f}, mean confidence "
                  f"{confidence:.2f} at accuracy {m['accuracy']:.2f}, mean entropy {m['entropy_mean']:.2f} nats); "
                  + ("choose the temperature on it (`tune` T) or re-temper the clients (`temperature`)" if tunable else
                     "its members are combined as point estimates: the default fusion (the label-shift pool) is "
                     "calibrated where it applies (docs/choosing.md)"), stacklevel=2)
