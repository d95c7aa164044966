"""``fit_components``: train M components from shared starting points and capture their posteriors.

Components are independent given their seeds (component m trains with seed
``train_seed·1_000_003 + m`` from starting point m), so a run interrupted after k components
can resume at component k and produce the same artifact as an uninterrupted run
(:func:`fit_and_write` with ``resume=True``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion import ranges
from posterior_fusion.artifact.writer import write_client_artifact
from posterior_fusion.curvature import BlockDiag, Diag
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.errors import (
    ConfigError,
    IncompatibleArtifactsError,
    ModelSpecError,
    OutputError,
    ResumeError,
)
from posterior_fusion.files import output_lock
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.laplace import laplace_backends
from posterior_fusion.local.capture.policy import block_policy, curvature_bytes
from posterior_fusion.local.fit_checks import (
    capture_cost_warning,
    check_batchnorm_fit,
    check_component_count,
    fit_metadata,
    local_model_epochs,
    local_model_teacher,
    prior_only,
    probe_capture,
    vanishing_blocks,
)
from posterior_fusion.local.fit_config import FitConfig, capture_dtype_problem
from posterior_fusion.local.init import (
    finetune_start,
    init_fingerprint,
    initial_weights,
    read_base,
)
from posterior_fusion.local.ppd import distil_ppd
from posterior_fusion.local.resume import partial_path, resume_state
from posterior_fusion.local.train import TrainResult, train_map
from posterior_fusion.models import ModelSpec, non_parameter_state
from posterior_fusion.models.batchnorm import batch_norms, fold_statistics, thaw
from posterior_fusion.models.layers import unsupported_reason
from posterior_fusion.posterior import Component, frozen_mapping
from posterior_fusion.runtime import resolve_device


def fit_components(spec: ModelSpec, data: SiloData, inits: list[torch.Tensor], cfg: FitConfig, log=print,
              done: list[Component] | None = None,
              on_component: Callable[[dict, list[Component]], None] | None = None,
              prior_mean: torch.Tensor | None = None) -> tuple[dict, list[Component]]:
    """Fit one component per initial vector in ``inits``; returns ``(metadata, components)``.

    ``done``: components already finished by an interrupted run (indices 0..k-1), kept as they
    are. ``on_component(metadata, components_so_far)`` is called after each new component.
    ``prior_mean`` ``(d,)``: the prior N(prior_mean, λ0⁻¹ I) is centred there (a pretrained base: the
    weight decay pulls to it), else at zero.
    """
    check_component_count(len(inits))
    if data.num_classes != spec.num_classes:
        raise IncompatibleArtifactsError(f"data has {data.num_classes} classes, model {spec.name!r} outputs {spec.num_classes}")
    spec.check_input(data.input_shape(), data.source or "data")
    spec.check_token_ids(data.x, data.source or "data")
    metadata = fit_metadata(spec, data, inits, cfg, prior_mean)
    dp_plan = noise = None
    if cfg.dp is not None:  # every data-dependent quantity through a mechanism (local/privacy/)
        from posterior_fusion.local.capture import private as private_capture
        from posterior_fusion.local.privacy import accounting
        from posterior_fusion.local.privacy import training as private_training

        if done:
            raise ConfigError("a differentially private fit cannot be resumed (its noise and budget are the run's own)")
        passes = private_training.ppd_passes(cfg.ppd, len(data), len(inits)) if cfg.ppd is not None else ()
        if cfg.local_model is not None:
            passes = (*passes, accounting.DPPass("local model", min(1.0, cfg.train.batch_size / len(data)),
                                         local_model_epochs(cfg) * math.ceil(len(data) / cfg.train.batch_size)))
        dp_plan = accounting.plan(cfg.dp, len(data), cfg.train.batch_size, cfg.train.epochs, len(inits), passes)
        noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)  # fresh per run
        counts = accounting.private_counts(data.class_counts(), dp_plan.release_noise, noise)
        metadata.update(class_counts=counts, n_data=sum(counts), dp=dp_plan.record(cfg.dp, cfg.structure))
        metadata.pop("data_sha256", None)  # a deterministic function of the data: not released
        transform = data.input_transform
        if transform.source.startswith("computed from") and not cfg.dp.dp_public_transform:
            raise ConfigError(f"{data.source or 'data'}: its input transform was {transform.source} — statistics of "
                              "data a private artifact would release unaccounted; import the silo with `--transform "
                              "none`, `constants:NAME` or `from:FILE` of public data (then set `dp_public_transform`)")
        if transform.source.startswith("computed from"):  # fitted on public data: kept, but not its file's name
            metadata["input_transform"] = replace(transform, source="computed from public data").to_dict()
        cfg = cfg.resolved(sum(counts))  # the weight decay from the released size, as DP-SGD uses it
        metadata["train"] = asdict(cfg.train)
        recipe = {"spec": spec.to_json(), "config": cfg.fingerprint_dict(), "dp": metadata["dp"],
                  "inits": [hashlib.sha256(w.detach().cpu().float().numpy().tobytes()).hexdigest() for w in inits]}
        # of the recipe and the released values only: a hash of the data would tell which data set the silo had
        metadata["fit_fingerprint"] = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()
    else:
        cfg = cfg.resolved(len(data))
    device = resolve_device(cfg.device)
    probe = spec.build()
    state = non_parameter_state(probe)
    if state is not None:
        raise ModelSpecError(f"model {spec.name!r}: {state}")
    folds = prior_mean is None and bool(batch_norms(probe))  # BatchNorm from random starting points
    if folds:
        check_batchnorm_fit(spec, probe, cfg)
        metadata["batchnorm"] = "fold"
    layout = ParameterLayout.from_model(probe)
    if cfg.capture == "laplace":
        laplace_backends()  # a broken laplace-torch install is refused before any training
    x, y = (t.to(device) for t in data.tensors())
    reason = unsupported_reason(probe.to(device), x[:2])  # the fast capture's own check, on two samples (flags embeddings)
    problem = capture_dtype_problem(cfg.capture_dtype, cfg.capture, reason)
    if problem is not None:  # before any training: nothing to lose
        raise ConfigError(problem)
    fast = cfg.capture == "fast" and reason is None
    if not done:
        probe_capture(spec, probe, x[:2], y[:2], cfg)
        bare = prior_only(probe, cfg.structure, cfg.dp is not None) if fast else ""
        if bare:
            warnings.warn(f"no curvature, the prior alone, for {bare}", stacklevel=2)
        costly = capture_cost_warning(probe, x, y, cfg, len(data), len(inits)) if fast else None
        if costly:
            warnings.warn(costly, stacklevel=2)
    per_component = 4 * layout.dim + curvature_bytes(probe, cfg.structure)
    log(f"fit-local: n = {len(data)}, M = {len(inits)}, {layout.dim:,} parameters, structure {cfg.structure}"
        + (f" ({cfg.kfac})" if cfg.structure == "kron" else "") + f", ggn {cfg.ggn}, device {device.type}; "
        f"artifact about {per_component / 2**20:.3g} MiB per component (MAP and curvature"
        + (", plain factors: `compress` shrinks them" if cfg.structure == "kron" and not cfg.compression.budget else "")
        + ")")
    comps = list(done or [])
    if [c.index for c in comps] != list(range(len(comps))) or len(comps) > len(inits):
        raise ConfigError("resumed components must be 0..k-1 of the same run")
    if prior_mean is not None and prior_mean.shape != (layout.dim,):
        raise IncompatibleArtifactsError(f"the prior mean has shape {tuple(prior_mean.shape)}, model needs ({layout.dim},)")
    gradient_noise = None if dp_plan is None else \
        torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)  # Opacus' noise
    soft_targets = local_model_teacher(cfg, x, y, spec.num_classes, log, dp_plan, gradient_noise) \
        if cfg.local_model is not None and len(comps) < len(inits) else None
    for m in range(len(comps), len(inits)):
        w0 = inits[m]
        if w0.shape != (layout.dim,):
            raise IncompatibleArtifactsError(f"initial vector {m} has shape {tuple(w0.shape)}, model needs ({layout.dim},)")
        model = spec.build().to(device)
        vector_to_parameters(w0.to(device).clone(), model.parameters())
        component_seed = cfg.train_seed * 1_000_003 + m
        torch.manual_seed(component_seed)
        t0 = time.perf_counter()
        statistics = None
        if dp_plan is not None:
            swag = private_training.private_train(model, x, y, cfg.train, cfg.dp, dp_plan, cfg.train.weight_decay,
                                    int.from_bytes(os.urandom(8), "little") >> 1, gradient_noise,
                                    None if prior_mean is None else prior_mean.to(device), soft_targets,
                                    cfg.local_model.weight if cfg.local_model else 0.0)
            res = TrainResult(float("nan"), float("nan"), swag)  # the loss and accuracy are not released
            t1 = time.perf_counter()
            if cfg.structure == "kron":
                curv = private_capture.private_kron(model, x, cfg.dp, dp_plan.release_noise, int(metadata["n_data"]), noise,
                                       cfg.kfac)
            elif cfg.structure == "diag+full":
                curv = private_capture.private_diag_full(model, x, cfg.dp, dp_plan.release_noise, noise)
            else:
                curv = BlockDiag([Diag(private_capture.private_diagonal(model, x, cfg.dp, dp_plan.release_noise, noise))])
            captured_by = "fast"
        else:
            res = train_map(thaw(model) if folds else model, x, y, cfg.train, seed=component_seed,
                            desc=f"component {m + 1}/{len(inits)}",
                            soft_targets=soft_targets, soft_weight=cfg.local_model.weight if cfg.local_model else 0.0,
                            prior_mean=None if prior_mean is None else prior_mean.to(device))
            # the silo's statistics at the trained weights, folded into the affine parameters (models/batchnorm.py)
            statistics = fold_statistics(model, x, cfg.curvature_batch_size) if folds else None
            t1 = time.perf_counter()
            curv, captured_by = capture(cfg.structure, model, x, y, cfg.curvature_batch_size, cfg.ggn, cfg.capture,
                                        torch.Generator().manual_seed(component_seed), log, cfg.kfac, cfg.capture_dtype)
        t2 = time.perf_counter()
        if captured_by == "fast":  # what each parameter's block holds (docs/methods.md, "Layer policy")
            metadata["curvature_blocks"] = {name: "prior" if kind == "residual" and cfg.dp is not None else kind
                                            for name, kind in block_policy(model, cfg.structure, cfg.kfac)}
        if m == 0 and (zero := vanishing_blocks(model, curv, cfg.structure, cfg.kfac)):
            warnings.warn(f"numerically zero curvature (the prior alone in effect) for {', '.join(zero[:4])}"
                          f"{', …' if len(zero) > 4 else ''}: the data does not constrain them at this point", stacklevel=2)
        training = {"seed": component_seed, "epochs": cfg.train.epochs, "final_loss": res.final_loss,
                    "final_accuracy": res.final_accuracy, "train_seconds": round(t1 - t0, 3),
                    "curvature_seconds": round(t2 - t1, 3), "capture": captured_by, "device": device.type}
        if dp_plan is not None:  # the loss, the accuracy and the timings on the silo are not released
            for key in ("final_loss", "final_accuracy", "train_seconds", "curvature_seconds"):
                training.pop(key)
        student = None
        if cfg.ppd is not None:
            w_map = parameters_to_vector(model.parameters()).detach().clone()
            centre = None if prior_mean is None else prior_mean.to(device)
            if dp_plan is not None:
                student, record = private_training.private_ppd(lambda: spec.build().to(device), w_map, x, y, cfg.ppd, cfg.dp,
                                                 dp_plan, cfg.prior_precision, cfg.temperature,
                                                 int.from_bytes(os.urandom(8), "little") >> 1, gradient_noise, centre)
                training.update(ppd_chain_excess_noise=record["chain_excess_noise"])
            else:
                student, record = distil_ppd(lambda: spec.build().to(device), w_map, x, y, cfg.ppd,
                                             cfg.prior_precision, cfg.temperature, seed=component_seed,
                                             prior_mean=centre)
            training.update(ppd_samples=record["samples"], ppd_seconds=round(time.perf_counter() - t2, 3))
        said = "" if dp_plan is not None else f"loss {res.final_loss:.4f} acc {res.final_accuracy:.3f} "
        log(f"component {m + 1}/{len(inits)}: {said}train {t1 - t0:.1f}s curvature {t2 - t1:.1f}s")
        w = parameters_to_vector(model.parameters()).detach().cpu().clone()
        comps.append(Component(m, w, curv, frozen_mapping(training), cfg.temperature, cfg.prior_precision, res.swag,
                               student, statistics))
        if on_component is not None:
            on_component(metadata, comps)
    return metadata, comps


def fit_and_write(spec: ModelSpec, data: SiloData, inits: list[torch.Tensor], cfg: FitConfig,
                out: str | os.PathLike, init_info: dict[str, Any], resume: bool = False,
                log: Callable[[str], None] = print,
                prior_mean: torch.Tensor | None = None) -> tuple[dict, list[Component]]:
    """Fit and write the client artifact ``out``, saving a partial artifact after each
    component (``.<out>.partial.h5``); with ``resume`` a partial run of the same fit continues.
    ``prior_mean``: the base the prior is centred at (:func:`fit_components`), stored in the artifact."""
    check_component_count(len(inits), init_info.get("file"))
    layout = ParameterLayout.from_model(spec.build())
    init_info = dict(init_info, fingerprint=init_fingerprint(spec, inits))
    fingerprint = fit_metadata(spec, data, inits, cfg, prior_mean)["fit_fingerprint"]
    inputs = [data.source or None, init_info.get("file")]
    with output_lock(out, inputs):  # checked writable and not an input before the work; one writer at a time
        done = resume_state(out, fingerprint, len(inits), resume, log)
        partial = partial_path(out)

        def save_partial(meta: dict, comps: list[Component]) -> None:
            write_client_artifact(partial, spec, layout, dict(meta, init=init_info, partial=True), comps,
                                  cfg.compression, prior_mean)

        try:
            meta, comps = fit_components(spec, data, inits, cfg, log=log, done=done, on_component=save_partial,
                                         prior_mean=prior_mean)
        except KeyboardInterrupt:
            kept = f"the finished components are kept in {partial}; " if partial.exists() else ""
            raise ResumeError(f"interrupted; {kept}rerun the same command with `resume` to continue") from None
        meta["init"] = init_info
        try:
            write_client_artifact(out, spec, layout, meta, comps, cfg.compression, prior_mean)
        except OutputError as exc:
            raise OutputError(f"{exc}; the finished components are kept in {partial} (rerun with `resume`)") from None
        partial.unlink(missing_ok=True)
    return meta, comps


@dataclass(frozen=True)
class Start:
    """Where a silo's components start — exactly one of:

    * ``init_seed`` (with ``components``): M starting points drawn from the seed (``fit-local --init-seed``);
    * ``init_file``: the starting points of ``pfuse init`` (their count, model and seed are the file's; where the
      file holds a pretrained base, the components fine-tune it and the prior is centred there);
    * ``base``: a pretrained base file every component starts at (the prior centred there), refused in one line
      where ``base_sha256`` is given and differs (the Flower node's own copy of the run's base).
    """

    init_seed: int = 0
    components: int | None = None  # None: one from a seed or base; an init file's own count (checked where given)
    init_file: str | os.PathLike | None = None
    base: str | os.PathLike | None = None
    base_sha256: str | None = None


def init_file_seed(meta: dict, init_path: str | os.PathLike) -> int:
    """An init file's recorded ``init_seed`` (the server's value), checked with the seed's range."""
    seed = meta.get("init_seed", 0) or 0
    if not ranges.is_int(seed):
        raise ConfigError(f"{init_path}: metadata init_seed must be an integer, got {str(seed)[:40]!r}")
    ranges.check(f"{init_path}: metadata init_seed", seed, ranges.SEED)
    return int(seed)


def fit_local(spec: ModelSpec | None, silo_path: str | os.PathLike, start: Start, cfg: FitConfig,
              out: str | os.PathLike, log: Callable[[str], None] = print, resume: bool = False,
              max_memory: int | str | None = None) -> tuple[dict, list]:
    """What ``pfuse fit-local`` does, for the CLI, the Flower node and the experiment grid alike: read the silo, start its
    components where ``start`` says, fit them and write the artifact to ``out``.

    Args:
        spec: the model (None with an init file: the file's; a spec that differs from the file's is refused).
        silo_path: the silo's data file.
        start: where the components start (:class:`Start`: seeds, an init file or a base).
        cfg: the fit settings (:class:`~posterior_fusion.local.fit_config.FitConfig`).
        out: the artifact to write (atomically; a partial file beside it while it runs).
        log: called with each progress line.
        resume: continue an interrupted run from its partial file.
        max_memory: the memory limit, bytes or a size [default: 80% of available memory].

    Returns:
        ``(metadata, components)``: the artifact's metadata and its M fitted components (MAP ``(d,)`` and curvature
        each).
    """
    from posterior_fusion.artifact.reader import load_global
    from posterior_fusion.data.transform import check_transform

    if start.init_file is not None:
        init_art = load_global(start.init_file, max_memory)
        if init_art.method != "init":
            raise ConfigError(f"{start.init_file}: is a fused global artifact (method {init_art.method!r}), not an "
                              "init file from 'pfuse init'")
        if spec is not None and spec != init_art.model_spec:
            raise ConfigError(f"{start.init_file}: holds starting points for {init_art.model_spec.to_json()}, but the "
                              f"model asked for (`model`) is {spec.to_json()}")
        spec, inits = init_art.model_spec, list(init_art.members)
        if start.components is not None and start.components != len(inits):
            raise ConfigError(f"{start.init_file}: holds {len(inits)} starting points, but `components` asks for "
                              f"{start.components}")
        data = read_silo(silo_path, num_classes=spec.num_classes, max_memory=max_memory)
        check_transform(init_art.metadata.get("input_transform"), data.input_transform, str(silo_path),
                        str(start.init_file))
        init_info: dict[str, Any] = {"file": str(start.init_file)}
        prior_mean = None
        if isinstance(init_art.metadata.get("base"), dict):
            init_info["base_sha256"] = str(init_art.metadata["base"].get("sha256"))
            spec, inits, prior_mean = finetune_start(spec, inits[0], cfg.finetune, len(inits),
                                                     init_file_seed(init_art.metadata, start.init_file))
        elif cfg.finetune != "all":
            raise ConfigError(f"`finetune` {cfg.finetune} fine-tunes part of a pretrained base: start from an init file "
                              "that holds a base (pfuse init with a base file)")
        return fit_and_write(spec, data, inits, cfg, out, init_info, resume=resume, log=log, prior_mean=prior_mean)
    if spec is None:
        raise ConfigError("fit_local needs a model spec unless it starts from an init file")
    data = read_silo(silo_path, num_classes=spec.num_classes, max_memory=max_memory)
    if start.base is None:
        if cfg.finetune != "all":
            raise ConfigError(f"`finetune` {cfg.finetune} fine-tunes part of a pretrained base: start from an init file "
                              "that holds a base (pfuse init with a base file)")
        return fit_and_write(spec, data, initial_weights(spec, start.components or 1, start.init_seed), cfg, out,
                             {"init_seed": start.init_seed}, resume=resume, log=log)
    spec, w, sha = read_base(spec, start.base)  # with a BatchNorm model's statistics, frozen at the base's
    if start.base_sha256 is not None and sha != start.base_sha256:
        raise IncompatibleArtifactsError(f"{start.base}: SHA-256 {sha[:12]}… is not the base {start.base_sha256[:12]}… "
                                         "this federation fine-tunes")
    spec, inits, prior_mean = finetune_start(spec, w, cfg.finetune, start.components or 1, start.init_seed)
    return fit_and_write(spec, data, inits, cfg, out, {"base_sha256": sha}, resume=resume, log=log,
                         prior_mean=prior_mean)
