"""``fit_local``: train M components from shared starting points and capture their posteriors.

Components are independent given their seeds (component m trains with seed
``seed·1_000_003 + m`` from starting point m), so a run interrupted after k components can
resume at component k and produce the same artifact as an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion.artifact.objects import Component, frozen_mapping
from posterior_fusion.artifact.writer import write_client_artifact
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.errors import ConfigError
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import capture
from posterior_fusion.local.init import initial_weights
from posterior_fusion.local.train import TrainConfig, train_map
from posterior_fusion.models import ModelSpec


@dataclass(frozen=True)
class FitConfig:
    structure: str = "kron"
    temperature: float = 0.1
    prior_var: float = 0.1
    seed: int = 0
    curvature_batch_size: int = 256
    ggn: str = "exact"            # "exact" GGN or "mc" (Monte-Carlo Fisher, 1 sample)
    train: TrainConfig = field(default_factory=TrainConfig)


def library_versions() -> dict[str, str]:
    out = {}
    for pkg in ("posterior-fusion", "torch", "laplace-torch", "curvlinops-for-pytorch", "asdfghjkl", "h5py", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def fit_metadata(spec: ModelSpec, data: SiloData, inits: list[torch.Tensor], cfg: FitConfig) -> dict:
    """Client metadata, including ``fit_fingerprint``: a hash of everything that determines the result."""
    if not cfg.temperature > 0 or not cfg.prior_var > 0:
        raise ConfigError("--temperature and --prior-var must be > 0")
    n = len(data)
    prior_precision = 1.0 / cfg.prior_var
    train_cfg = cfg.train
    if train_cfg.weight_decay < 0:  # negative = automatic: the tempered-posterior MAP
        train_cfg = replace(train_cfg, weight_decay=cfg.temperature * prior_precision / n)
    h = hashlib.sha256()
    h.update(spec.to_json().encode())
    h.update(json.dumps(asdict(replace(cfg, train=train_cfg)), sort_keys=True).encode())
    h.update(data.sha256().encode())
    for w in inits:
        h.update(w.detach().cpu().float().numpy().tobytes())
    return {
        "n_data": n, "class_counts": data.class_counts(), "num_classes": data.num_classes,
        "dataset": data.dataset, "data_sha256": data.sha256(),
        "temperature": cfg.temperature, "prior_precision": prior_precision, "structure": cfg.structure,
        "seed": cfg.seed, "curvature_batch_size": cfg.curvature_batch_size, "ggn": cfg.ggn,
        "train": asdict(train_cfg), "library_versions": library_versions(), "fit_fingerprint": h.hexdigest(),
    }


def fit_local(spec: ModelSpec, data: SiloData, inits: list[torch.Tensor], cfg: FitConfig, log=print,
              done: list[Component] | None = None,
              on_component: Callable[[dict, list[Component]], None] | None = None) -> tuple[dict, list[Component]]:
    """Fit one component per initial vector in ``inits``; returns ``(metadata, components)``.

    ``done``: components already finished by an interrupted run (indices 0..k-1), kept as they
    are. ``on_component(metadata, components_so_far)`` is called after each new component
    (``pfuse fit-local`` saves a partial artifact there).
    """
    if data.num_classes != spec.num_classes:
        raise ConfigError(f"data has {data.num_classes} classes, model {spec.name!r} outputs {spec.num_classes}")
    metadata = fit_metadata(spec, data, inits, cfg)
    train_cfg = TrainConfig(**metadata["train"])
    prior_precision = metadata["prior_precision"]
    x, y = data.tensors()
    layout = ParameterLayout.from_model(spec.build())
    comps = list(done or [])
    if [c.index for c in comps] != list(range(len(comps))) or len(comps) > len(inits):
        raise ConfigError("resumed components must be 0..k-1 of the same run")
    for m in range(len(comps), len(inits)):
        w0 = inits[m]
        if w0.shape != (layout.dim,):
            raise ConfigError(f"initial vector {m} has shape {tuple(w0.shape)}, model needs ({layout.dim},)")
        model = spec.build()
        vector_to_parameters(w0.clone(), model.parameters())
        component_seed = cfg.seed * 1_000_003 + m
        torch.manual_seed(component_seed)
        t0 = time.perf_counter()
        res = train_map(model, x, y, train_cfg, seed=component_seed, desc=f"component {m + 1}/{len(inits)}")
        t1 = time.perf_counter()
        curv = capture(cfg.structure, model, x, y, cfg.curvature_batch_size, cfg.ggn)
        t2 = time.perf_counter()
        training = {"seed": component_seed, "epochs": train_cfg.epochs, "final_loss": res.final_loss,
                    "final_accuracy": res.final_accuracy, "train_seconds": round(t1 - t0, 3),
                    "curvature_seconds": round(t2 - t1, 3)}
        log(f"component {m + 1}/{len(inits)}: loss {res.final_loss:.4f} acc {res.final_accuracy:.3f} "
            f"train {t1 - t0:.1f}s curvature {t2 - t1:.1f}s")
        w = parameters_to_vector(model.parameters()).detach().clone()
        comps.append(Component(m, w, curv, frozen_mapping(training), cfg.temperature, prior_precision, res.swag))
        if on_component is not None:
            on_component(metadata, comps)
    return metadata, comps


def fit_silo_to_artifact(spec: ModelSpec, silo_path: str | os.PathLike, out: str | os.PathLike, mixtures: int,
                         init_seed: int, cfg: FitConfig, log=print) -> dict:
    """Read a silo, fit ``mixtures`` components from the ``init_seed`` starting points, write the
    artifact to ``out``: what ``pfuse fit-local --init-seed`` does. Returns the metadata."""
    data = read_silo(silo_path, num_classes=spec.num_classes)
    meta, comps = fit_local(spec, data, initial_weights(spec, mixtures, init_seed), cfg, log=log)
    meta["init"] = {"init_seed": init_seed}
    write_client_artifact(out, spec, ParameterLayout.from_model(spec.build()), meta, comps)
    return meta
