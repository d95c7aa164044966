"""Build experiment splits on disk: client silos, a disjoint server validation set, a test set."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from posterior_fusion.data.idx import find_fmnist_dir, load_fmnist
from posterior_fusion.data.partition import dirichlet_partition
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import ConfigError

DATASETS = ("fmnist",)


def partition_to_files(
    out_dir: str | os.PathLike, dataset: str = "fmnist", clients: int = 5, alpha: float = 0.1,
    partition_seed: int = 0, val_size: int = 500, min_size: int = 10, scheme: str = "fedbens",
    data_dir: str | os.PathLike | None = None, max_train: int | None = None,
) -> dict:
    """Write ``client_<i>.h5``, ``server_val.h5`` and ``test.h5`` into ``out_dir``.

    The server validation set (``val_size`` samples drawn with ``partition_seed``) is removed from the
    training pool before partitioning, so it is disjoint from every client. Returns a summary
    dict with paths and per-client class counts.
    """
    if dataset not in DATASETS:
        raise ConfigError(f"unknown dataset {dataset!r}; available: {', '.join(DATASETS)}")
    source = find_fmnist_dir(data_dir)
    x, y = load_fmnist("train", source)
    xt, yt = load_fmnist("test", source)
    rng = np.random.default_rng(partition_seed)
    order = rng.permutation(len(y))
    if max_train is not None:
        order = order[: max_train + val_size]
    if val_size < 0 or val_size >= len(order):
        raise ConfigError(f"--val-size {val_size} must be in [0, {len(order)})")
    val_idx, pool = order[:val_size], order[val_size:]
    parts = dirichlet_partition(y[pool], clients, alpha, partition_seed, min_size=min_size, scheme=scheme)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"dataset": dataset, "source": str(source), "alpha": alpha, "partition_seed": partition_seed, "scheme": scheme,
               "clients": [], "server_val": str(out / "server_val.h5"), "test": str(out / "test.h5")}
    for c, local in enumerate(parts):
        idx = pool[local]
        silo = SiloData(x[idx], y[idx], dataset, 10)
        path = out / f"client_{c}.h5"
        write_silo(path, silo)
        summary["clients"].append({"path": str(path), "n": len(silo), "class_counts": silo.class_counts()})
    write_silo(out / "server_val.h5", SiloData(x[val_idx], y[val_idx], dataset, 10))
    write_silo(out / "test.h5", SiloData(xt, yt, dataset, 10))
    return summary
