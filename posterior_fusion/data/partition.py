"""Non-IID partitions of a labelled dataset across clients."""

from __future__ import annotations

import numpy as np

from posterior_fusion.errors import ConfigError


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int,
    min_size: int = 10, scheme: str = "fedbens", max_tries: int = 1000,
) -> list[np.ndarray]:
    """Split indices of ``labels`` ``(n,)`` into ``num_clients`` index arrays.

    ``scheme="fedbens"``: each client draws class proportions ``Dir(α·1_K)``; each class is
    split across clients by the normalised proportions of that class.
    ``scheme="per-class"``: for each class, proportions over clients are ``Dir(α·1_C)``
    (Hsu et al. 2019). Draws are repeated until every client has ``min_size`` samples.
    """
    if num_clients < 1:
        raise ConfigError("`clients` must be >= 1")
    if not alpha > 0:
        raise ConfigError("`alpha` must be > 0")
    if scheme not in ("fedbens", "per-class"):
        raise ConfigError(f"unknown partition scheme {scheme!r}; use 'fedbens' or 'per-class'")
    if min_size * num_clients > len(labels):
        raise ConfigError(f"cannot give {num_clients} clients {min_size} samples each from {len(labels)}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        if scheme == "fedbens":
            props = rng.dirichlet(alpha * np.ones(len(classes)), size=num_clients)  # (C, K)
        else:
            props = rng.dirichlet(alpha * np.ones(num_clients), size=len(classes)).T  # (C, K)
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for k_idx, k in enumerate(classes):
            idx = rng.permutation(np.flatnonzero(labels == k))
            p = props[:, k_idx]
            p = p / p.sum() if p.sum() > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for c, chunk in enumerate(np.split(idx, cuts)):
                parts[c].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(o) for o in out) >= min_size:
            return out
    raise ConfigError(f"no partition with every client >= {min_size} samples after {max_tries} draws; lower `min_size`")


def label_skew_partition(labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int,
                         min_size: int = 1) -> list[np.ndarray]:
    """"At most k classes per client" (the split of FedAvg's pathological non-IID setting, used by
    FedBE and FedPPD): client c owns classes ``perm[(c·k + j) mod K]``, j < k, for a random class
    permutation; each class is split evenly, at random, among the clients that own it."""
    classes = np.unique(labels)
    K = len(classes)
    if not 1 <= classes_per_client <= K:
        raise ConfigError(f"`classes_per_client` must be in [1, {K}]")
    if num_clients * classes_per_client < K:
        raise ConfigError(f"{num_clients} clients with {classes_per_client} classes each cannot cover {K} classes")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(K)
    owners: dict[int, list[int]] = {int(k): [] for k in range(K)}
    for c in range(num_clients):
        for j in range(classes_per_client):
            owners[int(perm[(c * classes_per_client + j) % K])].append(c)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k_idx, k in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(labels == k))
        for chunk, c in zip(np.array_split(idx, len(owners[k_idx])), owners[k_idx]):
            parts[c].append(chunk)
    out = [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts]
    if min(len(o) for o in out) < min_size:
        raise ConfigError(f"a client got fewer than {min_size} samples; lower `min_size` or use fewer clients")
    return out


def fedbens_reference_partition(labels: np.ndarray, num_clients: int, alpha: float, num_classes: int,
                                num_val: int = 500, seed: int = 3) -> tuple[list[np.ndarray], np.ndarray]:
    """The FedBEns authors' partition and validation draw (jacopot96/FedBEns, ``data.py`` and
    ``main_FedBEns_*.py``), reproduced call for call on NumPy's legacy generator:

    ``np.random.seed(3)``; for each client ``dirichlet(α·1_K)``; for each class k in order:
    shuffle the indices of class k, split them by the class's normalised proportions
    (``cumsum · n_k`` truncated); then shuffle each client's index list; then the server
    validation set is ``choice(n, 500)`` **with replacement from the whole training set**
    (it overlaps the clients). No minimum client size. Every run with any training seed uses
    this one partition. Returns ``(client index arrays, validation indices)``.
    """
    rs = np.random.RandomState(seed)  # the same stream as np.random.seed(seed) + module functions
    props = np.zeros((num_clients, num_classes))
    for i in range(num_clients):
        props[i] = rs.dirichlet(np.repeat(alpha, num_classes))
    batches: list[list[int]] = [[] for _ in range(num_clients)]
    for k in range(num_classes):
        idx_k = np.where(labels == k)[0]
        rs.shuffle(idx_k)
        p = props[:, k] / props[:, k].sum()
        cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
        batches = [b + part.tolist() for b, part in zip(batches, np.split(idx_k, cuts))]
    for b in batches:
        rs.shuffle(b)
    val = rs.choice(len(labels), num_val)
    return [np.asarray(b, dtype=np.int64) for b in batches], val
