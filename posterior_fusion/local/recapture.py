"""``recapture``: another curvature structure for the components a client artifact already trained.

Training never looks at the curvature structure: a ``fit-local --structure diag`` run with the same
seeds trains the very models a ``--structure kron`` run trained, and differs only in the capture
after training. Recapturing the stored MAPs on the same silo therefore gives the artifact the
other fit would have written (same MAPs, same capture, the MC capture drawing from the same
per-component generator), at the cost of the capture alone (≈ 3–6 training epochs per component
instead of ``epochs``). The silo must be the one the artifact was fitted on (its SHA-256 is checked).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable

import torch

from posterior_fusion import ranges
from posterior_fusion.artifact.reader import load_client
from posterior_fusion.artifact.writer import write_client_artifact
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.data.transform import check_transform
from posterior_fusion.errors import IncompatibleArtifactsError, shown
from posterior_fusion.files import output_lock
from posterior_fusion.local.capture import capture
from posterior_fusion.local.fastcapture import block_policy
from posterior_fusion.local.fit import library_versions
from posterior_fusion.posterior import ClientPosterior, Component, build_model, frozen_mapping
from posterior_fusion.runtime import resolve_device


def recapture(source: ClientPosterior, data: SiloData, structure: str, ggn: str | None = None,
              curvature_batch_size: int | None = None, method: str = "fast",
              log: Callable[[str], None] = print, kfac: str = "expand",
              device: str = "auto") -> tuple[dict, list[Component]]:
    """Capture ``structure`` at every component MAP of ``source``; returns ``(metadata, components)``.

    ``ggn`` and ``curvature_batch_size`` default to the source's. Everything else (MAPs, SWAG
    moments, FedPPD students, training records, temperature, prior) is kept; the metadata records
    what the artifact was recaptured from.
    """
    meta = dict(source.metadata)
    if meta.get("partial"):
        raise IncompatibleArtifactsError(f"{source.path}: is the partial file of an interrupted fit-local run; "
                                         "finish it with fit-local `resume` first")
    ggn = meta.get("ggn", "exact") if ggn is None else ggn  # structure, method and ggn: checked by capture()
    recorded = meta.get("curvature_batch_size", 256)
    if curvature_batch_size is None and (not isinstance(recorded, int) or isinstance(recorded, bool)):
        raise IncompatibleArtifactsError(f"{source.path} [/]: metadata curvature_batch_size must be an integer, "
                                         f"got {shown(recorded, 40)}")
    batch = recorded if curvature_batch_size is None else curvature_batch_size
    ranges.check("curvature_batch_size", batch, ranges.BATCH_SIZE)
    if meta.get("data_sha256") != data.sha256():
        raise IncompatibleArtifactsError(
            f"{data.source or 'data'}: is not the silo {source.path} was fitted on (data SHA-256 "
            f"{data.sha256()[:12]}…, the artifact records {str(meta.get('data_sha256'))[:12]}…)")
    check_transform(meta.get("input_transform"), data.input_transform, data.source or "data", source.path)
    if data.num_classes != source.model_spec.num_classes:
        raise IncompatibleArtifactsError(f"{data.source or 'data'}: has {data.num_classes} classes, "
                                         f"{source.path}'s model outputs {source.model_spec.num_classes}")
    where = resolve_device(device)
    x, y = (t.to(where) for t in data.tensors())
    comps = []
    policy = None
    for c in source.components:
        model = build_model(source.model_spec, c.map).to(where)
        seed = int(c.training.get("seed", c.index))
        t0 = time.perf_counter()
        curv, captured_by = capture(structure, model, x, y, batch, ggn, method, torch.Generator().manual_seed(seed), log,
                                    kfac)
        if captured_by == "fast":
            policy = dict(block_policy(model, structure))
        seconds = time.perf_counter() - t0
        log(f"component {c.index + 1}/{len(source.components)}: {structure} curvature {seconds:.1f}s")
        training = dict(c.training, curvature_seconds=round(seconds, 3), capture=captured_by, device=where.type)
        comps.append(Component(c.index, c.map, curv, frozen_mapping(training), c.temperature, c.prior_precision,
                               c.swag, c.student))
    origin = {"fit_fingerprint": meta.get("fit_fingerprint"), "structure": meta.get("structure"),
              "file_sha256": source.sha256, "library_versions": meta.get("library_versions")}
    meta.pop("num_components", None)
    for key in ("kfac", "curvature_blocks", "compress"):
        meta.pop(key, None)
    recipe = {"from": origin["fit_fingerprint"], "structure": structure, "ggn": ggn, "batch": batch}
    if structure == "kron":
        meta["kfac"] = kfac
        if kfac != "expand":  # expand keeps the key recaptures had before `kfac` existed
            recipe["kfac"] = kfac
    if policy is not None:
        meta["curvature_blocks"] = policy
    meta.update(structure=structure, ggn=ggn, curvature_batch_size=batch, recaptured_from=origin,
                library_versions=library_versions(),
                fit_fingerprint=hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest())
    return meta, comps


def recapture_to_file(source_path: str | os.PathLike, silo_path: str | os.PathLike, out: str | os.PathLike,
                      structure: str, ggn: str | None = None, curvature_batch_size: int | None = None,
                      method: str = "fast", max_memory: int | str | None = None,
                      log: Callable[[str], None] = print, kfac: str = "expand", device: str = "auto",
                      compress: float = 0.0) -> dict:
    """What ``pfuse recapture`` does: validate the source artifact and the silo, recapture, write
    ``out`` atomically. Returns the new metadata."""
    with output_lock(out, inputs=[source_path, silo_path]):  # checked before anything is loaded
        source = load_client(source_path, max_memory)
        data = read_silo(silo_path, num_classes=source.model_spec.num_classes, max_memory=max_memory)
        meta, comps = recapture(source, data, structure, ggn, curvature_batch_size, method, log, kfac, device)
        if compress > 0:
            meta["compress"] = compress
        write_client_artifact(out, source.model_spec, source.layout, meta, comps, compress)
    return meta
