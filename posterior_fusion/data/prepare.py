"""Build data files on disk: import a data set (``pfuse import-data``) and split one into client
silos, a disjoint server validation set and a test set (``pfuse partition``)."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import numpy as np

from posterior_fusion.choices import PROTOCOLS
from posterior_fusion.data.class_names import source_class_names
from posterior_fusion.data.idx import find_fmnist_dir, load_fmnist
from posterior_fusion.data.importers import IntegerInputs, load_source
from posterior_fusion.data.partition import dirichlet_partition, fedbens_reference_partition, label_skew_partition
from posterior_fusion.data.silo import SiloData, read_silo, write_silo
from posterior_fusion.data.transform import InputTransform
from posterior_fusion.errors import ConfigError, DataError
from posterior_fusion.files import atomic_folder, check_output

DATASETS = ("fmnist",)
SCHEMES = ("fedbens", "per-class", "label-skew")


def resolve_transform(spec: str, x: np.ndarray, source: str) -> InputTransform:
    """``auto`` (computed from ``x``), ``none``, ``constants:NAME`` or ``from:FILE`` (another data file's)."""
    if spec == "auto":
        return InputTransform.compute(x, source)
    if spec == "none":
        return InputTransform(1 / 255 if x.dtype == np.uint8 else 1.0, (0.0,), (1.0,), "none")
    if spec.startswith("constants:"):
        return InputTransform.constants(spec.split(":", 1)[1], x.dtype == np.uint8)
    if spec.startswith("from:"):
        other = read_silo(spec.split(":", 1)[1], labels=False)
        return other.input_transform
    raise ConfigError(f"`transform` takes auto, none, constants:NAME or from:FILE, got {spec!r}")


def import_data(source: str, out: str | os.PathLike, fmt: str = "auto", transform: str = "auto",
                name: str | None = None, num_classes: int | None = None, **kwargs) -> dict:
    """Read ``source`` (see :mod:`.importers`) and write the silo file ``out`` with its transform.
    ``out`` may not be one of the inputs; what is written is what :func:`read_silo` accepts."""
    from_file = transform.split(":", 1)[1] if transform.startswith("from:") else None
    check_output(out, inputs=[source, kwargs.get("labels"), from_file])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IntegerInputs)
        x, y = load_source(source, fmt, **kwargs)
    for w in caught:
        if not issubclass(w.category, IntegerInputs):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    integers = any(issubclass(w.category, IntegerInputs) for w in caught)
    k = num_classes if num_classes is not None else (int(y.max()) + 1 if y is not None and y.size else 0)
    if y is not None and (k < 1 or y.max() >= k):
        raise DataError(f"{source}: labels reach {int(y.max())}, more than `num_classes` {k} allows")
    if transform == "auto" and integers and x.ndim == 2:
        warnings.warn(f"{source}: the inputs are stored as integers (token ids?); `transform` auto standardises them "
                      "feature by feature, so an embedding would see no ids — use `transform` none to keep them as "
                      "they are", stacklevel=2)
    t = resolve_transform(transform, x, str(source))
    dataset = name or Path(str(source).split(":")[-1]).stem
    names = source_class_names(source, fmt, **kwargs) if y is not None else ()
    names = names if len(names) == max(k, 1) else ()
    write_silo(out, SiloData(x, y, dataset, max(k, 1), str(source), t, names))
    return {"out": str(out), "n": int(x.shape[0]), "input_shape": list(x.shape[1:]), "dtype": str(x.dtype),
            "num_classes": k, "labels": y is not None, "transform": t.to_dict(), "dataset": dataset,
            **({"class_names": list(names)} if names else {})}


def _split_indices(labels: np.ndarray, clients: int, alpha: float, seed: int, min_size: int, scheme: str,
                   classes_per_client: int | None) -> list[np.ndarray]:
    if scheme == "label-skew":
        if classes_per_client is None:
            raise ConfigError("`scheme` label-skew needs `classes_per_client`")
        return label_skew_partition(labels, clients, classes_per_client, seed, min_size)
    return dirichlet_partition(labels, clients, alpha, seed, min_size=min_size, scheme=scheme)


def partition_to_files(
    out_dir: str | os.PathLike, dataset: str = "fmnist", clients: int = 5, alpha: float = 0.1,
    partition_seed: int = 0, val_size: int = 500, min_size: int = 10, scheme: str = "fedbens",
    data_dir: str | os.PathLike | None = None, max_train: int | None = None, source: str | os.PathLike | None = None,
    test: str | os.PathLike | None = None, classes_per_client: int | None = None, test_size: int = 0,
    protocol: str = "ours", unlabeled_size: int = 0,
) -> dict:
    """Write ``client_<i>.h5``, ``server_val.h5`` and (with a test split) ``test.h5`` into ``out_dir``.

    The data: ``source`` (an imported, labelled data file; ``test`` its test file) or the
    built-in ``dataset`` (Fashion-MNIST from ``data_dir``). The server validation set
    (``val_size`` samples drawn with ``partition_seed``) is removed from the training pool
    before partitioning, so it is disjoint from every client; so is ``server_unlabeled.h5``
    (``unlabeled_size`` > 0: that many further samples, written without labels — the unlabeled
    server data of FedBE, FedPPD and ``--distill``). Every file carries the source's input
    transform. Returns a summary dict with paths and per-client class counts.

    ``protocol="fedbens-reference"`` reproduces the FedBEns authors' split instead
    (:func:`~posterior_fusion.data.partition.fedbens_reference_partition`: NumPy seed 3 whatever
    ``partition_seed`` is, no minimum size, 500 validation samples drawn with replacement from
    the whole training set, MNIST normalisation (0.1307, 0.3081)).
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown partition scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    if source is not None:
        train = read_silo(source)
        x, y, name, k, t = train.x, train.labels(), train.dataset, train.num_classes, train.input_transform
        names = train.class_names
        test_data = read_silo(test, num_classes=k) if test else None
        origin = str(source)
    else:
        if dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {dataset!r}; available: {', '.join(DATASETS)} (or `from` FILE)")
        folder = find_fmnist_dir(data_dir)
        x, y = load_fmnist("train", folder)
        xt, yt = load_fmnist("test", folder)
        name, k, t = dataset, 10, InputTransform.constants("fmnist")
        names = ()
        test_data = SiloData(xt, yt, name, k, transform=t)
        origin = str(folder)
    if protocol == "fedbens-reference":
        if scheme != "fedbens" or max_train is not None or test_size or unlabeled_size:
            raise ConfigError("`protocol` fedbens-reference fixes the scheme (fedbens) and uses all training data")
        if source is None:
            t = InputTransform.constants("mnist")
            test_data = SiloData(test_data.x, test_data.labels(), name, k, transform=t)
        parts, val_idx = fedbens_reference_partition(y, clients, alpha, k, num_val=val_size)
        return _write_split(Path(out_dir), x, y, name, k, t, parts, np.arange(len(y)), val_idx, None, test_data,
                            {"dataset": name, "source": origin, "alpha": alpha, "partition_seed": 3,
                             "scheme": scheme, "protocol": protocol}, names)
    rng = np.random.default_rng(partition_seed)
    order = rng.permutation(len(y))
    if test_size:
        if test_data is not None or not 0 < test_size < len(order):
            raise ConfigError("`test_size` needs `from` without `test`, and fewer samples than the data set")
        held, order = order[:test_size], order[test_size:]
        test_data = SiloData(x[held], y[held], name, k, transform=t)
    if max_train is not None:
        order = order[: max_train + val_size + unlabeled_size]
    if val_size < 0 or val_size >= len(order):
        raise ConfigError(f"`val_size` {val_size} leaves nothing to train on: the data has {len(order)} samples "
                          f"(after the test split); lower `val_size` (e.g. {len(order) // 10}) or set it to 0")
    val_idx, pool = order[:val_size], order[val_size:]
    if unlabeled_size:
        if not 0 < unlabeled_size < len(pool):
            raise ConfigError(f"`unlabeled_size` {unlabeled_size} leaves nothing to train on: {len(pool)} samples "
                              f"remain after the validation split; lower `unlabeled_size` (e.g. {len(pool) // 10})")
        unlabeled_idx, pool = pool[:unlabeled_size], pool[unlabeled_size:]
    else:
        unlabeled_idx = None
    parts = _split_indices(y[pool], clients, alpha, partition_seed, min_size, scheme, classes_per_client)
    return _write_split(Path(out_dir), x, y, name, k, t, parts, pool, val_idx, unlabeled_idx, test_data,
                        {"dataset": name, "source": origin, "alpha": alpha, "partition_seed": partition_seed,
                         "scheme": scheme, "protocol": protocol}, names)


_SPLIT_FILE = re.compile(r"^(client_[0-9]+\.h5|server_val\.h5|server_unlabeled\.h5|test\.h5|summary\.json)$")


def _write_split(out: Path, x, y, name, k, t, parts, pool, val_idx, unlabeled_idx, test_data, summary: dict,
                 names: tuple[str, ...] = ()) -> dict:
    """Write the split into a private folder and rename it to ``out`` as a whole: a killed run
    never leaves a folder mixing two splits (``out`` may hold only an earlier split's files)."""
    summary = dict(summary, clients=[], server_val=str(out / "server_val.h5") if len(val_idx) else None,
                   test=str(out / "test.h5") if test_data is not None else None, transform=t.to_dict(),
                   server_unlabeled=str(out / "server_unlabeled.h5") if unlabeled_idx is not None else None)
    with atomic_folder(out, owned=lambda n: bool(_SPLIT_FILE.match(n))) as tmp:
        for c, local in enumerate(parts):
            idx = pool[local]
            silo = SiloData(x[idx], y[idx], name, k, transform=t, class_names=names)
            write_silo(tmp / f"client_{c}.h5", silo)
            summary["clients"].append({"path": str(out / f"client_{c}.h5"), "n": len(silo),
                                       "class_counts": silo.class_counts()})
        if len(val_idx):  # val_size 0: no server validation file
            write_silo(tmp / "server_val.h5", SiloData(x[val_idx], y[val_idx], name, k, transform=t,
                                                       class_names=names))
        if unlabeled_idx is not None:
            write_silo(tmp / "server_unlabeled.h5", SiloData(x[unlabeled_idx], None, name, k, transform=t,
                                                             class_names=names))
        if test_data is not None:
            write_silo(tmp / "test.h5", SiloData(test_data.x, test_data.labels(), name, k, transform=t,
                                                 class_names=names))
    return summary
