"""Config-driven experiment grids (``pfuse experiment CONFIG.toml``).

For every (α, number of clients, seed): partition once; for every curvature structure: fit
every client once with the largest M of the grid (component m depends only on its own seed
and starting point, so the first m components of an M-component fit *are* the m-component
fit); then fuse with every method and M, evaluate on the test split, and aggregate mean ± std
over seeds into ``results.csv`` / ``results.md`` plus plots. Everything is cached under the
work folder, keyed by the settings that determine it, so a re-run, an interrupted run or a
new method never retrains.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import tomllib
import torch

from posterior_fusion.artifact import load_client
from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR
from posterior_fusion.data.prepare import partition_to_files
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.errors import ConfigError, MethodNotApplicableError
from posterior_fusion.fusion.common import FusionOptions
from posterior_fusion.fusion.registry import METHODS, fuse_clients
from posterior_fusion.fusion.tuning import tune_fusion
from posterior_fusion.local.fit import FitConfig, fit_silo_to_artifact, library_versions
from posterior_fusion.local.init import initial_weights
from posterior_fusion.local.train import TrainConfig, train_map
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.models import ModelSpec


@dataclass(frozen=True)
class ExperimentConfig:
    """A grid; every list is an axis. See benchmarks/*.toml for examples."""

    name: str = "experiment"
    data: str = "system"              # "system" (Debian FMNIST, else embedded) or "embedded"
    max_train: int | None = None      # cap on training samples (smoke runs)
    alphas: list[float] = field(default_factory=lambda: [0.1])
    clients: list[int] = field(default_factory=lambda: [5])
    seeds: list[int] = field(default_factory=lambda: [0])
    mixtures: list[int] = field(default_factory=lambda: [5])
    structures: list[str] = field(default_factory=lambda: ["kron"])
    methods: list[str] = field(default_factory=lambda: ["fedbens", "fedfisher", "regmean", "fisher-merge", "fedavg"])
    model: str = "lenet"
    epochs: int = 20
    steps: int = 300
    temperature: float = 0.1
    prior_var: float = 0.1
    val_size: int = 500
    temperatures: list[float] = field(default_factory=list)  # server re-tempering sweep for fedbens
    tune: bool = False                # fedbens with T and prior chosen on validation ("fedbens-tuned")
    tune_temperatures: list[float] = field(default_factory=lambda: [0.01, 0.03, 0.1, 0.3, 1.0])
    tune_prior_vars: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0])
    centralized: bool = True          # pooled-data upper bound

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> ExperimentConfig:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read config ({exc})") from None
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        cfg = cls(**raw)
        cfg.validate(path)
        return cfg

    def validate(self, where: str | os.PathLike = "config") -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ConfigError(f"{where}: unknown methods {bad}; available: {list(METHODS)}")
        if self.data not in ("system", "embedded"):
            raise ConfigError(f"{where}: data must be 'system' or 'embedded'")
        if not all(a > 0 for a in self.alphas) or not all(m >= 1 for m in self.mixtures) or not self.seeds:
            raise ConfigError(f"{where}: alphas must be > 0, mixtures >= 1, seeds non-empty")


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _fit_client(args: tuple) -> str:
    """Worker: fit one silo (runs in a separate process when jobs > 1)."""
    silo, out, spec_json, mixtures, seed, fit_cfg_json, threads = args
    if threads:
        torch.set_num_threads(threads)
    spec = ModelSpec.from_json(spec_json)
    cfg_dict = json.loads(fit_cfg_json)
    cfg = FitConfig(**{**cfg_dict, "train": TrainConfig(**cfg_dict["train"])})
    fit_silo_to_artifact(spec, silo, out, mixtures, seed, cfg, log=lambda m: None)
    return out


def _centralized(spec: ModelSpec, silos: list[SiloData], test: SiloData, epochs: int, seed: int, cfg: FitConfig) -> dict:
    import numpy as np

    pooled = SiloData(np.concatenate([s.x for s in silos]), np.concatenate([s.y for s in silos]), silos[0].dataset, 10)
    x, y = pooled.tensors()
    model = spec.build()
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    vector_to_parameters(initial_weights(spec, 1, seed)[0], model.parameters())
    torch.manual_seed(seed)
    train_map(model, x, y, replace(cfg.train, epochs=epochs,
                                   weight_decay=cfg.temperature / cfg.prior_var / len(pooled)), seed=seed)
    return evaluate_members(spec, [parameters_to_vector(model.parameters()).detach()], test)


def run_experiment(cfg: ExperimentConfig, work: str | os.PathLike, jobs: int = 1, log=print) -> list[dict]:
    """Run (or resume) the grid in ``work``; returns the per-seed rows and writes the tables."""
    work = Path(work)
    (work / "results").mkdir(parents=True, exist_ok=True)
    started = time.time()
    spec = ModelSpec(cfg.model, {})
    data_dir = EMBEDDED_FMNIST_DIR if cfg.data == "embedded" else None
    m_max = max(cfg.mixtures)
    rows = []
    cells = [(a, c, s) for a in cfg.alphas for c in cfg.clients for s in cfg.seeds]
    for n_cell, (alpha, n_clients, seed) in enumerate(cells, 1):
        pkey = _key({"data": cfg.data, "max_train": cfg.max_train, "alpha": alpha, "clients": n_clients,
                     "seed": seed, "val": cfg.val_size})
        pdir = work / "partitions" / pkey
        if not (pdir / "summary.json").exists():
            summary = partition_to_files(pdir, clients=n_clients, alpha=alpha, seed=seed, val_size=cfg.val_size,
                                         data_dir=data_dir, max_train=cfg.max_train)
            _write_json(pdir / "summary.json", summary)
        summary = json.loads((pdir / "summary.json").read_text())
        test, val = read_silo(summary["test"]), read_silo(summary["server_val"])
        log(f"[{n_cell}/{len(cells)}] alpha={alpha} clients={n_clients} seed={seed}: "
            f"{[c['n'] for c in summary['clients']]} samples")
        for structure in cfg.structures:
            fit_cfg = FitConfig(structure=structure, temperature=cfg.temperature, prior_var=cfg.prior_var, seed=seed,
                                train=TrainConfig(epochs=cfg.epochs, weight_decay=-1.0))
            ckey = _key({"p": pkey, "fit": asdict(fit_cfg), "M": m_max, "model": spec.to_json()})
            cdir = work / "clients" / ckey
            cdir.mkdir(parents=True, exist_ok=True)
            todo = [(c["path"], str(cdir / f"post_{i}.h5"), spec.to_json(), m_max, seed,
                     json.dumps(asdict(fit_cfg)), max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0)
                    for i, c in enumerate(summary["clients"]) if not (cdir / f"post_{i}.h5").exists()]
            t0 = time.perf_counter()
            if todo and jobs > 1:
                # spawn, not fork: forking after torch started its thread pools can deadlock
                with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                    for done in pool.map(_fit_client, todo):
                        log(f"  fitted {done}")
            for args in todo if jobs <= 1 else []:
                log(f"  fitted {_fit_client(args)}")
            if todo:
                log(f"  fit-local {structure}: {len(todo)} clients in {time.perf_counter() - t0:.0f}s")
            full = [load_client(cdir / f"post_{i}.h5") for i in range(n_clients)]
            runs = [(m, M, {}) for M in cfg.mixtures for m in cfg.methods]
            runs += [("fedbens", m_max, {"temperature": t}) for t in cfg.temperatures]
            runs += [("fedbens-tuned", m_max, {})] if cfg.tune else []
            for method, M, extra in runs:
                base = {"alpha": alpha, "clients": n_clients, "seed": seed, "structure": structure, "M": M,
                        "method": method, "temperature": extra.get("temperature", cfg.temperature)}
                rpath = work / "results" / f"{_key({'c': ckey, **base, 'steps': cfg.steps})}.json"
                if rpath.exists():
                    rows.append(json.loads(rpath.read_text()))
                    continue
                subset = [replace(c, components=c.components[:M]) for c in full]
                opts = FusionOptions(steps=cfg.steps, seed=seed, progress=False, **extra)
                try:
                    if method == "fedbens-tuned":
                        inputs, res, meta = tune_fusion(subset, "fedbens", opts, val, ("T", "prior"),
                                                        cfg.tune_temperatures, cfg.tune_prior_vars)
                    else:
                        inputs, res, meta = fuse_clients(subset, method, opts, val)
                except MethodNotApplicableError as exc:
                    log(f"  {method}: skipped ({exc})")
                    continue
                m = evaluate_members(spec, res.members, test)
                row = {**base, "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "brier": m["brier"],
                       "members": len(res.members), "fuse_seconds": meta["fuse_seconds"],
                       "tuning": meta.get("tuning", {}).get("chosen")}
                _write_json(rpath, row)
                rows.append(row)
                log(f"  {structure} M={M} {method}{'@T=' + str(extra['temperature']) if extra else ''}: "
                    f"accuracy {m['accuracy']:.4f}")
        if cfg.centralized:
            base = {"alpha": alpha, "clients": n_clients, "seed": seed, "structure": "-", "M": 1,
                    "method": "centralized", "temperature": cfg.temperature}
            rpath = work / "results" / f"{_key({'p': pkey, **base, 'epochs': cfg.epochs})}.json"
            if not rpath.exists():
                silos = [read_silo(c["path"]) for c in summary["clients"]]
                m = _centralized(spec, silos, test, cfg.epochs, seed, FitConfig(temperature=cfg.temperature,
                                                                                prior_var=cfg.prior_var))
                _write_json(rpath, {**base, "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"],
                                    "brier": m["brier"], "members": 1, "fuse_seconds": 0.0, "tuning": None})
                log(f"  centralized: accuracy {m['accuracy']:.4f}")
            rows.append(json.loads(rpath.read_text()))
        write_tables(rows, work, cfg)  # after every cell: an interrupted run leaves partial tables
        _write_json(work / "run.json", {"config": asdict(cfg), "jobs": jobs, "library_versions": library_versions(),
                                        "cells_done": n_cell, "cells": len(cells),
                                        "wall_seconds_this_invocation": round(time.time() - started, 1)})
    return rows


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean ± std over seeds for each (structure, M, method, temperature, α, clients)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        k = (r["structure"], r["M"], r["method"], r["temperature"], r["alpha"], r["clients"])
        groups.setdefault(k, []).append(r)
    out = []
    for (structure, M, method, temp, alpha, clients), rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        accs = [100 * r["accuracy"] for r in rs]
        mean = sum(accs) / len(accs)
        std = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)) if len(accs) > 1 else 0.0
        out.append({"structure": structure, "M": M, "method": method, "temperature": temp, "alpha": alpha,
                    "clients": clients, "seeds": len(rs), "accuracy_mean": round(mean, 2), "accuracy_std": round(std, 2),
                    "nll_mean": round(sum(r["nll"] for r in rs) / len(rs), 4)})
    return out


def write_tables(rows: list[dict], work: Path, cfg: ExperimentConfig) -> None:
    agg = aggregate(rows)
    with open(work / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(agg[0]) if agg else ["empty"])
        w.writeheader()
        w.writerows(agg)
    alphas = sorted({a["alpha"] for a in agg})
    lines = [f"# {cfg.name}: test accuracy % (mean ± std over seeds)", "",
             "| structure | M | method | T | " + " | ".join(f"α={a}" for a in alphas) + " |",
             "|---|---|---|---|" + "---|" * len(alphas)]
    keyed: dict[tuple, dict] = {}
    for a in agg:
        keyed.setdefault((a["structure"], a["M"], a["method"], a["temperature"]), {})[a["alpha"]] = a
    for (structure, M, method, temp), by_alpha in keyed.items():
        cells = [f"{by_alpha[a]['accuracy_mean']:.2f} ± {by_alpha[a]['accuracy_std']:.2f} ({by_alpha[a]['seeds']})"
                 if a in by_alpha else "–" for a in alphas]
        lines.append(f"| {structure} | {M} | {method} | {temp} | " + " | ".join(cells) + " |")
    (work / "results.md").write_text("\n".join(lines) + "\n")
    plot_results(agg, work, max(cfg.mixtures))


def plot_results(agg: list[dict], work: Path, m_max: int) -> None:
    """accuracy vs α per method; fedbens accuracy vs M; fedbens accuracy vs server temperature."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 4))
    for method in sorted({a["method"] for a in agg}):
        pts = sorted((a["alpha"], a["accuracy_mean"]) for a in agg if a["method"] == method
                     and a["M"] in (m_max, 1 if method == "centralized" else m_max))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=method)
    ax.set_xscale("log")
    ax.set_xlabel("Dirichlet α")
    ax.set_ylabel("test accuracy %")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(work / "accuracy_vs_alpha.png", dpi=100)
    plt.close(fig)
    for name, key, sel in (("accuracy_vs_M.png", "M", lambda a: a["method"] == "fedbens"),
                           ("accuracy_vs_temperature.png", "temperature", lambda a: a["method"] == "fedbens" and a["M"] == m_max)):
        fig, ax = plt.subplots(figsize=(5, 4))
        for alpha in sorted({a["alpha"] for a in agg}):
            pts = sorted((a[key], a["accuracy_mean"]) for a in agg if sel(a) and a["alpha"] == alpha)
            if len(pts) > 1:
                ax.plot(*zip(*pts), marker="o", label=f"α={alpha}")
        ax.set_xlabel(key)
        ax.set_ylabel("fedbens test accuracy %")
        if key == "temperature":
            ax.set_xscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(work / name, dpi=100)
        plt.close(fig)
