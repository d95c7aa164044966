"""``recapture``: another curvature structure for the components a client artifact already trained.

Training never looks at the curvature structure: a ``fit-local --structure diag`` run with the same
seeds trains the very models a ``--structure kron`` run trained, and differs only in the capture
after training. Recapturing the stored MAPs on the same silo therefore gives the artifact the
other fit would have written (same MAPs, same capture, the MC capture drawing from the same
per-component generator), at the cost of the capture alone (≈ 3–6 training epochs per component
instead of ``epochs``). The silo must be the one the artifact was fitted on (its SHA-256 is checked).

The refresh round, a capture at a fused global's members instead of the local MAPs, is
:mod:`posterior_fusion.local.refresh` (``pfuse refresh``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable

import torch

from posterior_fusion import ranges
from posterior_fusion.artifact.reader import load_client
from posterior_fusion.artifact.writer import write_client_artifact
from posterior_fusion.curvature.compressed import PLAIN, Compression
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.data.transform import check_transform
from posterior_fusion.errors import ConfigError, IncompatibleArtifactsError, shown
from posterior_fusion.files import output_lock
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.policy import block_policy
from posterior_fusion.local.fit_checks import library_versions
from posterior_fusion.local.fit_config import FitConfig
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.members import build_model
from posterior_fusion.posterior import ClientPosterior, Component, frozen_mapping
from posterior_fusion.runtime import resolve_device
from posterior_fusion.settings import declared_default


def merged_source(source: ClientPosterior) -> ClientPosterior:
    """``source`` (a fine-tuning spec) as an artifact of its whole architecture: each component's MAP the
    whole weight vector (:func:`~posterior_fusion.local.init.full_base`: frozen weights back, LoRA merged),
    its curvature to be captured again, the prior's centre the whole base, a BatchNorm model's statistics the
    base's (frozen, as in ``source``); metadata ``merged_from`` records the ``finetune`` setting. One line when
    ``source`` fine-tuned every weight."""
    from posterior_fusion.local.init import full_base

    spec = source.model_spec
    if spec.finetune == "all":
        raise ConfigError(f"{source.path}: fine-tuned every weight already (`finetune` all): nothing to merge")
    arch = ModelSpec(spec.name, dict(spec.kwargs), spec.provider)
    held = [name for name, _ in arch.frozen_shapes()]  # fine-tuning every weight freezes the statistics only
    if held:  # a BatchNorm model's statistics stay frozen at the base's (stored as the merged artifact's /frozen)
        arch = arch.with_base({name: spec.base[name] for name in held})
    comps = tuple(dataclasses.replace(c, map=full_base(spec, c.map), swag=None, student=None)
                  for c in source.components)
    meta = dict(source.metadata, merged_from={"finetune": spec.finetune})
    mean = None if source.prior_mean is None else full_base(spec, source.prior_mean)
    return ClientPosterior(source.path, source.sha256, arch, ParameterLayout.from_model(arch.build()),
                           frozen_mapping(meta), comps, mean)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a recapture and a refresh round share once their inputs are checked (:func:`prepare`)."""

    meta: dict           # the source's metadata, copied, ``num_components`` dropped
    ggn: str
    kfac: str
    batch: int           # the curvature pass's batch size
    x: torch.Tensor      # the silo's inputs on the capture's device
    y: torch.Tensor
    origin: dict         # the ``recaptured_from`` record


def prepare(source: ClientPosterior, data: SiloData, ggn: str | None, kfac: str | None,
            curvature_batch_size: int | None, device: str, private: bool) -> Prepared:
    """The checks every recapture makes before any capture: a non-private recapture of a private artifact, a
    partial artifact, a silo that is not the artifact's (SHA-256, transform, classes) are refused in one line;
    ``ggn``, ``kfac`` and the batch size default to the source's."""
    meta = dict(source.metadata)
    if isinstance(meta.get("dp"), dict) and not private:
        raise ConfigError(f"{source.path}: is differentially private; a recapture would release the silo's curvature "
                          "again outside its accounted budget (a private refresh round, `refresh_dp_epsilon`, may)")
    if meta.get("partial"):
        raise IncompatibleArtifactsError(f"{source.path}: is the partial file of an interrupted fit-local run; "
                                         "finish it with fit-local `resume` first")
    ggn = meta.get("ggn", declared_default(FitConfig, "ggn")) if ggn is None else ggn  # structure, method and ggn: checked by capture()
    kfac = (meta.get("kfac") or "expand") if kfac is None else kfac  # checked by capture()
    recorded = meta.get("curvature_batch_size", declared_default(FitConfig, "curvature_batch_size"))
    if curvature_batch_size is None and (not isinstance(recorded, int) or isinstance(recorded, bool)):
        raise IncompatibleArtifactsError(f"{source.path} [/]: metadata curvature_batch_size must be an integer, "
                                         f"got {shown(recorded, 40)}")
    batch = recorded if curvature_batch_size is None else curvature_batch_size
    ranges.check("curvature_batch_size", batch, ranges.BATCH_SIZE)
    hashed = not (isinstance(meta.get("dp"), dict) and "data_sha256" not in meta)  # a private fit releases no hash
    if hashed and meta.get("data_sha256") != data.sha256():
        raise IncompatibleArtifactsError(
            f"{data.source or 'data'}: is not the silo {source.path} was fitted on (data SHA-256 "
            f"{data.sha256()[:12]}…, the artifact records {str(meta.get('data_sha256'))[:12]}…)")
    check_transform(meta.get("input_transform"), data.input_transform, data.source or "data", source.path)
    if data.num_classes != source.model_spec.num_classes:
        raise IncompatibleArtifactsError(f"{data.source or 'data'}: has {data.num_classes} classes, "
                                         f"{source.path}'s model outputs {source.model_spec.num_classes}")
    where = resolve_device(device)
    x, y = (t.to(where) for t in data.tensors())
    origin = {"fit_fingerprint": meta.get("fit_fingerprint"), "structure": meta.get("structure"),
              "file_sha256": source.sha256, "library_versions": meta.get("library_versions")}
    meta.pop("num_components", None)
    return Prepared(meta, ggn, kfac, batch, x, y, origin)


def finish_metadata(prep: Prepared, structure: str, capture_dtype: str, policy: dict | None,
                    recipe_extra: dict | None = None) -> dict:
    """The recaptured artifact's metadata: the structure and capture recorded, ``recaptured_from``, and a fit
    fingerprint over the recipe (``recipe_extra`` adds a refresh round's part)."""
    meta = prep.meta
    for key in ("kfac", "curvature_blocks", "capture_dtype"):
        meta.pop(key, None)
    recipe = {"from": prep.origin["fit_fingerprint"], "structure": structure, "ggn": prep.ggn, "batch": prep.batch}
    if "merged_from" in meta:
        recipe["merged_from"] = meta["merged_from"]
    recipe.update(recipe_extra or {})
    if structure == "kron":
        meta["kfac"] = prep.kfac
        if prep.kfac != "expand":  # expand keeps the key recaptures had before `kfac` existed
            recipe["kfac"] = prep.kfac
    if capture_dtype != "float32":
        meta["capture_dtype"] = recipe["capture_dtype"] = capture_dtype
    if policy is not None:
        meta["curvature_blocks"] = policy
    meta.update(structure=structure, ggn=prep.ggn, curvature_batch_size=prep.batch, recaptured_from=prep.origin,
                library_versions=library_versions(),
                fit_fingerprint=hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest())
    return meta


def recapture(source: ClientPosterior, data: SiloData, structure: str, ggn: str | None = None,
              curvature_batch_size: int | None = None, method: str = "fast",
              log: Callable[[str], None] = print, kfac: str | None = None,
              device: str = "auto", capture_dtype: str = "float32") -> tuple[dict, list[Component]]:
    """Capture ``structure`` at every component MAP of ``source``; returns ``(metadata, components)``.

    ``ggn``, ``curvature_batch_size`` and ``kfac`` default to the source's (``kfac``: "expand" where
    the source records none); ``capture_dtype`` is this capture's own (default float32, whatever the
    source used). Everything else (MAPs, SWAG moments, FedPPD students, training records, temperature,
    prior) is kept; the metadata records what the artifact was recaptured from. A ``source`` from
    :func:`merged_source` is recaptured over its whole architecture (``merged_from`` recorded).
    """
    prep = prepare(source, data, ggn, kfac, curvature_batch_size, device, private=False)
    comps, policy = [], None
    for comp in source.components:
        model = build_model(source.model_spec, comp.map).to(prep.x.device)
        training = dict(comp.training)
        seed = int(training.get("seed", comp.index))
        t0 = time.perf_counter()
        curv, captured_by = capture(structure, model, prep.x, prep.y, prep.batch, prep.ggn, method,
                                    torch.Generator().manual_seed(seed), log, prep.kfac, capture_dtype)
        if captured_by == "fast":
            policy = dict(block_policy(model, structure, prep.kfac))
        seconds = time.perf_counter() - t0
        training.update(curvature_seconds=round(seconds, 3), capture=captured_by, device=prep.x.device.type)
        comps.append(Component(comp.index, comp.map, curv, frozen_mapping(training), comp.temperature,
                               comp.prior_precision, comp.swag, comp.student, comp.statistics))
        log(f"component {comp.index + 1}/{len(source.components)}: {structure} curvature {seconds:.1f}s")
    return finish_metadata(prep, structure, capture_dtype, policy), comps


def recapture_to_file(source_path: str | os.PathLike, silo_path: str | os.PathLike, out: str | os.PathLike,
                      structure: str | None, ggn: str | None = None, curvature_batch_size: int | None = None,
                      method: str = "fast", max_memory: int | str | None = None,
                      log: Callable[[str], None] = print, kfac: str | None = None, device: str = "auto",
                      compression: Compression = PLAIN, capture_dtype: str = "float32", merge: bool = False) -> dict:
    """What ``pfuse recapture`` does: validate the source artifact and the silo, recapture, write ``out``
    atomically. ``structure`` None: the source's; ``merge``: the source as one of its whole architecture first
    (:func:`merged_source`: the server then fuses the products ΔW with their own curvature rather than adapter
    factors). Returns the new metadata."""
    compression.validate()
    with output_lock(out, inputs=[source_path, silo_path]):  # checked before anything is loaded
        source = load_client(source_path, max_memory)
        structure = source.structure if structure is None else structure
        data = read_silo(silo_path, num_classes=source.model_spec.num_classes, max_memory=max_memory)
        if merge:
            source = merged_source(source)
        meta, comps = recapture(source, data, structure, ggn, curvature_batch_size, method, log, kfac, device,
                                capture_dtype)
        write_client_artifact(out, source.model_spec, source.layout, meta, comps, compression, source.prior_mean)
    return meta
