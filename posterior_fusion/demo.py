"""The end-to-end demo: partition -> fit-local per silo -> fuse with every method -> evaluate.

Its choices (:data:`DEMO_DATASETS`, :data:`DEMO_METHODS`, :data:`DEFAULT_ROW`) are read without torch
(``pfuse demo --help``); the pipeline's numerics are imported when :func:`run_demo` runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR, SYSTEM_FMNIST_DIR, find_fmnist_dir
from posterior_fusion.data.prepare import import_data, partition_to_files
from posterior_fusion.data.silo import read_silo
from posterior_fusion.errors import ConfigError, MethodNotApplicableError
from posterior_fusion.fusion.registry import DEFAULT_METHOD, DEFAULT_SETTINGS, DEMO, METHODS
from posterior_fusion.local.fit_config import FitConfig, TrainConfig

DEMO_METHODS = DEMO
DEMO_DATASETS = ("fmnist", "digits")
DEFAULT_ROW = "default"  # the demo's row of what `pfuse fuse` runs without --method


def legend(method: str) -> str:
    """The demo table's line for a row: the method's own summary (``FusionMethod.summary``), or what the
    default row runs."""
    if method == DEFAULT_ROW:
        return (f"what `pfuse fuse` runs without --method: {DEFAULT_METHOD} with "
                f"{', '.join(f'{k}={v}' for k, v in DEFAULT_SETTINGS.items())} (docs/choosing.md)")
    return METHODS[method].summary if method in METHODS else ""


def fmnist_source(subset: bool = False) -> tuple[Path, str]:
    """The Fashion-MNIST folder the demo uses and a description: the installed full set (Debian's
    ``dataset-fashion-mnist``) unless ``subset`` or it is missing, else the embedded subset."""
    folder = EMBEDDED_FMNIST_DIR if subset else find_fmnist_dir()
    if folder == SYSTEM_FMNIST_DIR:
        return folder, f"the full Fashion-MNIST ({folder})"
    return folder, (f"the embedded Fashion-MNIST subset ({folder}; 6,000 training images — smoke-sized, its "
                    "ranking of methods is not representative; install dataset-fashion-mnist for the full set)")


def demo_methods(structure: str) -> tuple[str, ...]:
    """The demo's methods that can fuse ``structure`` (each method declares its structures)."""
    return tuple(m for m in DEMO_METHODS if METHODS[m].applies_to(structure))


def run_demo(out_dir: str | os.PathLike, subset: bool = False, clients: int = 5, alpha: float = 0.1,
             components: int = 3, epochs: int = 5, structure: str = "kron", seed: int = 0,
             methods: tuple[str, ...] | None = None, steps: int = 300, max_train: int | None = None,
             log=print, dataset: str = "fmnist") -> list[dict]:
    """Run the whole pipeline in ``out_dir``; returns one row of test metrics per method.

    ``seed`` is the run seed: partition, init and training seeds all equal it. ``dataset``:
    ``fmnist`` (LeNet; the installed full set, or the embedded subset with ``subset`` or when the
    full set is not installed) or ``digits`` (scikit-learn's 8x8 handwritten digits, an MLP).
    ``methods`` None: the default fusion (row ``default``) and the demo's methods that apply to ``structure``."""
    from posterior_fusion.artifact import load_global
    from posterior_fusion.fusion import FusionOptions, applicable_settings, fuse, write_fused
    from posterior_fusion.local.fit import Start, fit_local
    from posterior_fusion.metrics import evaluate_members
    from posterior_fusion.models import ModelSpec

    if methods is None:
        methods = (DEFAULT_ROW, *demo_methods(structure))
    out = Path(out_dir)
    t0 = time.perf_counter()
    if dataset == "digits":
        import_data("sklearn:digits", out / "data" / "digits.h5")
        summary = partition_to_files(out / "data", clients=clients, alpha=alpha, partition_seed=seed, val_size=150,
                                     source=out / "data" / "digits.h5", test_size=400)
        spec = ModelSpec("mlp", {"in_features": 64, "hidden": 32})
    elif dataset == "fmnist":
        source, description = fmnist_source(subset)
        log(f"data: {description}")
        summary = partition_to_files(out / "data", clients=clients, alpha=alpha, partition_seed=seed,
                                     data_dir=source, max_train=max_train)
        spec = ModelSpec("lenet", {})
    else:
        raise ConfigError(f"unknown demo data set {dataset!r}; use one of {', '.join(DEMO_DATASETS)}")
    log(f"partitioned {summary['source']} into {clients} clients (alpha={alpha}): "
        + ", ".join(str(c["n"]) for c in summary["clients"]) + " samples")
    snapshots = TrainConfig.swag_snapshots_per_epoch * max(1, epochs // 4)  # SWAG's default window: the last E/4 epochs
    train = TrainConfig(epochs=epochs, swag=True, swag_rank=max(1, min(10, snapshots)))
    cfg = FitConfig(structure=structure, train_seed=seed, train=train)
    paths = []
    for i, c in enumerate(summary["clients"]):
        log(f"fit-local client {i} (n={c['n']}, M={components}, {structure}, {epochs} epochs)")
        paths.append(out / f"post_{i}.h5")
        fit_local(spec, c["path"], Start(seed, components), cfg, paths[-1], log=lambda m: log("  " + m))
    test = read_silo(summary["test"])
    rows = []
    for method in methods:
        try:
            named = None if method == DEFAULT_ROW else method
            inputs, result, meta = fuse(paths, named, FusionOptions(sampling_seed=seed),
                                        applicable_settings(named, {"steps": steps}) if named else None,
                                        val_path=summary["server_val"])
        except MethodNotApplicableError as exc:
            log(f"{method}: skipped ({exc})")
            continue
        gpath = out / f"global_{method}.h5"
        write_fused(gpath, inputs, result, meta)
        g = load_global(gpath)
        metrics = evaluate_members(g.model_spec, list(g.members), test, weights=g.mode_weights, pooling=g.pooling)
        rows.append({"method": method, "members": len(g.members), "fuse_seconds": meta["fuse_seconds"],
                     **{k: metrics[k] for k in ("accuracy", "nll", "ece", "brier", "member_accuracy_min", "member_accuracy_max")}})
        log(f"{method}: accuracy {metrics['accuracy']:.4f} ({meta['fuse_seconds']:.1f}s)")
    log(f"demo finished in {time.perf_counter() - t0:.0f}s; artifacts in {out}")
    return rows
