"""Running a grid with a cache at every level: partition -> client fits -> fusion results.

For every cell (α, number of clients, run seed): partition once; for every curvature
structure: fit every client once with the largest M of the grid (component m depends only on
its own seed and starting point, so the first m components of an M-component fit *are* the
m-component fit; training does not depend on the structure, so with ``share_training`` the
further structures are captured at the first structure's trained components); then fuse with
every method and M and evaluate on the test split. Each level is one function whose result is
cached under the work folder, keyed by the settings that determine it, so a re-run, an
interrupted run or a new method never retrains.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion.artifact import ClientPosterior, load_client
from posterior_fusion.artifact.preview import preview
from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR
from posterior_fusion.data.prepare import partition_to_files
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.errors import MethodNotApplicableError, ResumeError
from posterior_fusion.experiment.grid_config import ExperimentConfig
from posterior_fusion.experiment.report import write_tables
from posterior_fusion.files import write_text_atomically
from posterior_fusion.fusion import FusionOptions, applicable_settings, fuse_clients, get_method, method_settings
from posterior_fusion.fusion.distill import DistillConfig, distill_members
from posterior_fusion.fusion.tuning import tune_fusion
from posterior_fusion.local.fit import Start, fit_local
from posterior_fusion.local.fit_checks import library_versions
from posterior_fusion.local.fit_config import FitConfig, TrainConfig, fit_config_from
from posterior_fusion.local.init import initial_weights
from posterior_fusion.local.recapture import recapture_to_file
from posterior_fusion.local.resume import partial_path
from posterior_fusion.local.train import train_map
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.batchnorm import batch_norms, fold_statistics, thaw
from posterior_fusion.settings import declared_default

Log = Callable[[str], None]


def cache_key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json(path: Path, obj) -> None:
    write_text_atomically(path, json.dumps(obj, indent=2, default=str))


@dataclass(frozen=True)
class Cell:
    """One point of the data axes; ``seed`` is the run seed (partition = init = training seed)."""

    alpha: float
    clients: int
    seed: int


@dataclass(frozen=True)
class FitJob:
    """Fit one silo to one client artifact (runs in a worker process when jobs > 1)."""

    silo: str
    out: str
    spec_json: str
    components: int
    init_seed: int
    fit: FitConfig
    threads: int = 0

    def run(self, log: Log = lambda m: None) -> str:
        if self.threads:
            torch.set_num_threads(self.threads)
        spec = ModelSpec.from_json(self.spec_json)
        try:  # an interrupted grid continues its clients' partial fits (same fingerprint only)
            fit_local(spec, self.silo, Start(self.init_seed, self.components), self.fit, self.out, log=log,
                      resume=partial_path(self.out).exists())
        except ResumeError as exc:
            log(f"note: {exc}; starting this client afresh")
            partial_path(self.out).unlink(missing_ok=True)
            fit_local(spec, self.silo, Start(self.init_seed, self.components), self.fit, self.out, log=log)
        return self.out


def _run_fit_job(job: FitJob) -> str:
    return job.run()


@dataclass(frozen=True)
class FuseJob:
    """One fusion of a cell: ``method`` on the first ``M`` components, optionally re-tempered
    (``temperature``) or, for a tunable method, with T and σ0² chosen on validation data (``tuned``;
    its rows are labelled ``<method>-tuned``)."""

    method: str
    M: int
    temperature: float | None = None
    tuned: bool = False
    distill: bool = False
    variant: str | None = None

    @property
    def label(self) -> str:
        name = self.variant or self.method
        return f"{name}-tuned" if self.tuned else f"{name}+distill" if self.distill else name


def client_fit_config(cfg: ExperimentConfig, structure: str, seed: int) -> FitConfig:
    """The fit of every client of a cell: the grid's own keys (epochs, temperature, prior_var, the
    structure axis and the run seed) over the TOML's ``[fit]`` table of fit settings."""
    return fit_config_from({**cfg.fit, "structure": structure, "temperature": cfg.temperature,
                            "prior_var": cfg.prior_var, "train_seed": seed, "epochs": cfg.epochs}, f"{cfg.name}: ")


def partition_cell(cfg: ExperimentConfig, cell: Cell, work: Path) -> tuple[str, dict]:
    """Level 1: the cell's silos, validation and test files; returns ``(key, summary)``."""
    key = {"data": cfg.data, "max_train": cfg.max_train, "alpha": cell.alpha, "clients": cell.clients,
           "seed": cell.seed, "val": cfg.val_size}
    if cfg.protocol != "ours":  # older caches (protocol "ours") keep their keys
        key["protocol"] = cfg.protocol
    if cfg.unlabeled_size:
        key["unlabeled"] = cfg.unlabeled_size
    pkey = cache_key(key)
    pdir = work / "partitions" / pkey
    if not (pdir / "summary.json").exists():
        summary = partition_to_files(pdir, clients=cell.clients, alpha=cell.alpha, partition_seed=cell.seed,
                                     val_size=cfg.val_size, max_train=cfg.max_train, protocol=cfg.protocol,
                                     unlabeled_size=cfg.unlabeled_size,
                                     data_dir=EMBEDDED_FMNIST_DIR if cfg.data == "embedded" else None)
        write_json(pdir / "summary.json", summary)
    return pkey, json.loads((pdir / "summary.json").read_text())


def fit_clients(cfg: ExperimentConfig, cell: Cell, structure: str, pkey: str, summary: dict, work: Path,
                jobs: int, log: Log) -> tuple[str, list[ClientPosterior]]:
    """Level 2: every client of the cell fitted once with the largest M; returns ``(key, posteriors)``."""
    spec = cfg.spec
    m_max = max(cfg.components)
    fit_cfg = client_fit_config(cfg, structure, cell.seed)
    fit_key = fit_cfg.fingerprint_dict()
    ckey = cache_key({"p": pkey, "fit": fit_key, "M": m_max, "model": spec.to_json()})
    cdir = work / "clients" / ckey
    if not cdir.exists():
        older = equivalent_cached_fits(work, summary, spec, fit_cfg, m_max, cell.seed)
        if older is not None:
            log(f"  reusing the fits in {older} (cached under an older key scheme; same data and settings)")
            ckey, cdir = older.name, older
    cdir.mkdir(parents=True, exist_ok=True)
    drop_stale_fits(cdir, log)
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0
    todo = [FitJob(c["path"], str(cdir / f"post_{i}.h5"), spec.to_json(), m_max, cell.seed, fit_cfg, threads)
            for i, c in enumerate(summary["clients"]) if not (cdir / f"post_{i}.h5").exists()]
    t0 = time.perf_counter()
    if todo and jobs > 1:
        # spawn, not fork: forking after torch started its thread pools can deadlock
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for done in pool.map(_run_fit_job, todo):
                log(f"  fitted {done}")
    for k, job in enumerate(todo if jobs <= 1 else []):
        log(f"  fitting client {k + 1}/{len(todo)} ({structure}, M={m_max}, {cfg.epochs} epochs)")
        log(f"  fitted {job.run(log=lambda m: log('    ' + m))}")
    if todo:
        log(f"  fit-local {structure}: {len(todo)} clients in {time.perf_counter() - t0:.0f}s")
    return ckey, [load_client(cdir / f"post_{i}.h5") for i in range(cell.clients)]


def drop_stale_fits(cdir: Path, log: Log) -> None:
    """Delete the cached artifacts of ``cdir`` that cannot join its other ones, so they are made
    again: in a folder mixing artifacts that record no input transform (written before versions
    recorded it) with artifacts that record one — an interrupted fit resumed across versions — the
    unrecorded ones. A folder whose artifacts all record none, or that records two different
    transforms (a data problem: fusion refuses it, naming both files), is left as it is."""
    recorded = {path: preview(path)["metadata"].get("input_transform") for path in sorted(cdir.glob("post_*.h5"))}
    if None not in recorded.values() or all(t is None for t in recorded.values()):
        return
    for path, transform in recorded.items():
        if transform is None:
            log(f"  making {path} again: written by an older version that did not record the input transform "
                "its folder's other artifacts record (one client set must share one transform)")
            path.unlink()


def recapture_clients(cfg: ExperimentConfig, cell: Cell, structure: str, base_key: str, summary: dict, work: Path,
                      log: Log) -> tuple[str, list[ClientPosterior]]:
    """Level 2, a further structure: the clients of ``base_key`` recaptured with ``structure`` at
    their trained MAPs (``pfuse recapture``; equal to fitting with that structure, for the cost of
    the capture alone), with the grid's ``[fit] kfac`` and ``capture_dtype``. Runs in this process whatever
    ``jobs`` says."""
    fit = client_fit_config(cfg, structure, cell.seed)
    kfac = fit.kfac  # in the key as in the fit fingerprint (only where not the default)
    ckey = cache_key({"recapture": base_key, "structure": structure,
                      **{k: v for k, v in fit.fingerprint_dict().items() if k in ("kfac", "capture_dtype")}})
    cdir = work / "clients" / ckey
    cdir.mkdir(parents=True, exist_ok=True)
    drop_stale_fits(cdir, log)
    t0 = time.perf_counter()
    todo = [i for i in range(cell.clients) if not (cdir / f"post_{i}.h5").exists()]
    for k, i in enumerate(todo):
        log(f"  recapturing client {k + 1}/{len(todo)} ({structure} at the trained components of {base_key})")
        recapture_to_file(work / "clients" / base_key / f"post_{i}.h5", summary["clients"][i]["path"],
                          cdir / f"post_{i}.h5", structure, log=lambda m: log("    " + m), kfac=kfac,
                          capture_dtype=fit.capture_dtype)
    if todo:
        log(f"  recapture {structure}: {len(todo)} clients in {time.perf_counter() - t0:.0f}s")
    return ckey, [load_client(cdir / f"post_{i}.h5") for i in range(cell.clients)]


def equivalent_cached_fits(work: Path, summary: dict, spec: ModelSpec, fit_cfg: FitConfig, m_max: int,
                           init_seed: int) -> Path | None:
    """A client folder written for the same cell under an older cache key: its first artifact
    was fitted on this cell's first silo (data hash), with this model, M and settings. Settings
    fields the older artifact does not record must hold their defaults now (an option added
    later defaults to the old behaviour)."""
    import h5py

    want_sha = read_silo(summary["clients"][0]["path"]).sha256()
    resolved = fit_cfg.resolved(summary["clients"][0]["n"])
    want_train = asdict(resolved.train)
    defaults = asdict(TrainConfig())
    for cdir in sorted((work / "clients").iterdir()) if (work / "clients").exists() else []:
        first = cdir / "post_0.h5"
        if not first.exists():
            continue
        try:
            with h5py.File(first, "r") as f:
                meta = json.loads(f.attrs["metadata"])
                model = json.loads(f.attrs["model_spec"])
        except (OSError, KeyError, ValueError):
            continue
        train = meta.get("train", {})
        same = (meta.get("data_sha256") == want_sha and meta.get("num_components") == m_max
                and model.get("name") == spec.name and dict(model.get("kwargs", {})) == dict(spec.kwargs)
                and meta.get("structure") == resolved.structure
                and meta.get("train_seed", meta.get("seed")) == resolved.train_seed  # "seed" before the rename
                and meta.get("init", {}).get("init_seed", init_seed) == init_seed
                and meta.get("temperature") == resolved.temperature
                and meta.get("prior_precision") == resolved.prior_precision
                and meta.get("ggn", declared_default(FitConfig, "ggn")) == resolved.ggn
                and meta.get("curvature_batch_size") == resolved.curvature_batch_size
                and all(train[k] == v if k in train else v == defaults[k] for k, v in want_train.items()))
        if same:
            return cdir
    return None


def fuse_jobs(cfg: ExperimentConfig) -> list[FuseJob]:
    """Every method at every M; the tunable methods (``FusionMethod.tunable``) also re-tempered at
    each of ``temperatures`` and, with ``tune``, tuned on validation data."""
    jobs = [FuseJob(m, M) for M in cfg.components for m in cfg.methods]
    tunable = [m for m in cfg.methods if get_method(m).tunable]
    jobs += [FuseJob(m, max(cfg.components), t) for m in tunable for t in cfg.temperatures]
    jobs += [FuseJob(m, max(cfg.components), tuned=True) for m in tunable] if cfg.tune else []
    jobs += [FuseJob(v["method"], M, variant=label) for M in cfg.components for label, v in cfg.variants.items()]
    jobs += [FuseJob(cfg.variants[m]["method"] if m in cfg.variants else m, M, distill=True,
                     variant=m if m in cfg.variants else None) for M in cfg.components for m in cfg.distill]
    return jobs


def result_keys(ckey: str, base: dict, steps: int, method: str, settings: dict) -> tuple[str, str]:
    """The cache key of one fusion result and the key earlier versions used. The key holds only the
    method's settings that differ from their defaults, so a setting added to a method later (at its
    default, the old behaviour) leaves cached results valid; the legacy key held the whole record."""
    chosen = asdict(method_settings(method, settings))
    defaults = asdict(method_settings(method, {}))
    own = {k: v for k, v in chosen.items() if k not in defaults or defaults[k] != v}
    return (cache_key({"c": ckey, **base, "steps": steps, "non_default_settings": own}),
            cache_key({"c": ckey, **base, "steps": steps, "settings": chosen}))


def fuse_result(cfg: ExperimentConfig, cell: Cell, structure: str, ckey: str, job: FuseJob,
                clients: list[ClientPosterior], val: SiloData, test: SiloData, work: Path, log: Log,
                unlabeled: SiloData | None = None) -> dict | None:
    """Level 3: one fusion evaluated on the test split (``None`` if the method does not apply).
    ``unlabeled``: the server's unlabeled data (methods that distil by themselves use it; a
    ``distill`` job distils the fused members into one model on it, its time in ``fuse_seconds``)."""
    base = {"alpha": cell.alpha, "clients": cell.clients, "seed": cell.seed, "structure": structure, "M": job.M,
            "method": job.label, "temperature": job.temperature if job.temperature is not None else cfg.temperature}
    method = job.method
    own = {k: v for k, v in cfg.variants.get(job.variant, {}).items() if k != "method"}
    settings = {**applicable_settings(method, {"steps": cfg.steps}), **own}
    key, legacy = result_keys(ckey, base, cfg.steps, method, settings)
    rpath = work / "results" / f"{key}.json"
    if rpath.exists():
        return json.loads(rpath.read_text())
    if (work / "results" / f"{legacy}.json").exists():  # cached before the key left out default settings
        return json.loads((work / "results" / f"{legacy}.json").read_text())
    subset = [replace(c, components=c.components[: job.M]) for c in clients]
    log(f"  {structure} M={job.M} {job.label}: fusing{' and distilling' if job.distill else ''}…")
    opts = FusionOptions(sampling_seed=cell.seed, progress=False, temperature=job.temperature)
    try:
        if job.tuned:
            _, res, meta = tune_fusion(subset, method, opts, val, ("T", "prior"), cfg.tune_temperatures,
                                       cfg.tune_prior_vars, settings=settings)
        else:
            _, res, meta = fuse_clients(subset, method, opts, settings, val, unlabeled)
    except MethodNotApplicableError as exc:
        log(f"  {job.label}: skipped ({exc})")
        return None
    if job.distill and not get_method(method).distils:
        t0 = time.perf_counter()
        w, record = distill_members(cfg.spec, res.members, unlabeled.inputs(), DistillConfig(), cell.seed,
                                    show_progress=False, weights=res.mode_weights,
                                    pooling=res.pooling(cfg.spec.num_classes))
        res = res.distilled(w, record)
        meta = {**meta, "fuse_seconds": meta["fuse_seconds"] + time.perf_counter() - t0}
    m = evaluate_members(cfg.spec, res.members, test, weights=res.mode_weights, pooling=res.pooling(cfg.spec.num_classes))
    row = {**base, "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "brier": m["brier"],
           "members": len(res.members), "fuse_seconds": meta["fuse_seconds"], "tuning": meta.get("tuning", {}).get("chosen")}
    write_json(rpath, row)
    log(f"  {structure} M={job.M} {job.label}{'' if job.temperature is None else f'@T={job.temperature}'}: "
        f"accuracy {m['accuracy']:.4f}")
    return row


def centralized_result(cfg: ExperimentConfig, cell: Cell, pkey: str, summary: dict, test: SiloData, work: Path,
                       log: Log) -> dict:
    """The pooled-data bound: one model trained on all silos with the same recipe (tempered MAP)."""
    base = {"alpha": cell.alpha, "clients": cell.clients, "seed": cell.seed, "structure": "-", "M": 1,
            "method": "centralized", "temperature": cfg.temperature}
    rpath = work / "results" / f"{cache_key({'p': pkey, **base, 'epochs': cfg.epochs})}.json"
    if not rpath.exists():
        silos = [read_silo(c["path"]) for c in summary["clients"]]
        pooled = SiloData(np.concatenate([s.x for s in silos]), np.concatenate([s.y for s in silos]), silos[0].dataset,
                          silos[0].num_classes, transform=silos[0].transform)
        spec = cfg.spec
        fit = client_fit_config(cfg, FitConfig().structure, cell.seed).resolved(len(pooled))
        model = spec.build()
        vector_to_parameters(initial_weights(spec, 1, cell.seed)[0], model.parameters())
        torch.manual_seed(cell.seed)
        x, y = pooled.tensors()
        folds = bool(batch_norms(model))  # BatchNorm trains with batch statistics, then folds them as a silo does
        train_map(thaw(model) if folds else model, x, y, fit.train, seed=cell.seed)
        if folds:
            fold_statistics(model, x, fit.curvature_batch_size)
        m = evaluate_members(spec, [parameters_to_vector(model.parameters()).detach()], test)
        write_json(rpath, {**base, "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "brier": m["brier"],
                           "members": 1, "fuse_seconds": 0.0, "tuning": None})
        log(f"  centralized: accuracy {m['accuracy']:.4f}")
    return json.loads(rpath.read_text())


def run_experiment(cfg: ExperimentConfig, work: str | os.PathLike, jobs: int = 1, log: Log = print) -> list[dict]:
    """Run (or resume) the grid in ``work``; returns the per-seed rows and writes the tables."""
    work = Path(work)
    (work / "results").mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows = []
    cells = [Cell(a, c, s) for a in cfg.alphas for c in cfg.clients for s in cfg.seeds]
    for n_cell, cell in enumerate(cells, 1):
        pkey, summary = partition_cell(cfg, cell, work)
        test = read_silo(summary["test"])
        val = read_silo(summary["server_val"]) if summary.get("server_val") else None  # val_size 0: none
        unlabeled = read_silo(summary["server_unlabeled"], labels=False) if summary.get("server_unlabeled") else None
        log(f"[{n_cell}/{len(cells)}] alpha={cell.alpha} clients={cell.clients} seed={cell.seed}: "
            f"{[c['n'] for c in summary['clients']]} samples")
        base = None
        for structure in cfg.structures:
            if base is not None and cfg.share_training:
                ckey, clients = recapture_clients(cfg, cell, structure, base, summary, work, log)
            else:
                ckey, clients = fit_clients(cfg, cell, structure, pkey, summary, work, jobs, log)
                base = base or ckey
            for job in fuse_jobs(cfg):
                row = fuse_result(cfg, cell, structure, ckey, job, clients, val, test, work, log, unlabeled)
                if row is not None:
                    rows.append(row)
        if cfg.centralized:
            rows.append(centralized_result(cfg, cell, pkey, summary, test, work, log))
        write_tables(rows, work, cfg)  # after every cell: an interrupted run leaves partial tables
        write_json(work / "run.json", {"config": asdict(cfg), "jobs": jobs, "library_versions": library_versions(),
                                       "cells_done": n_cell, "cells": len(cells),
                                       "wall_seconds_this_invocation": round(time.time() - started, 1)})
    return rows
