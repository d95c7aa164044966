"""The explicit registry of fusion methods and the ``fuse`` entry point."""

from __future__ import annotations

import os
import time
from dataclasses import asdict

from posterior_fusion.artifact import ClientPosterior, load_client
from posterior_fusion.artifact.reader import declared_bytes
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.errors import ConfigError, IncompatibleArtifactsError, ResourceLimitError, SchemaError
from posterior_fusion.fusion.baselines import ensemble, fedavg, fisher_merge, product, regmean
from posterior_fusion.fusion.common import FusionInputs, FusionMethod, FusionOptions, FusionResult, check_compatible
from posterior_fusion.fusion.fedbens import fedbens
from posterior_fusion.fusion.fedfisher import fedfisher
from posterior_fusion.fusion.resources import default_limit, estimate_fuse_bytes
from posterior_fusion.fusion.robust import screen_clients
from posterior_fusion.fusion.sampling import fedbe, swag_ensemble
from posterior_fusion.fusion.tuning import tune_fusion

METHODS: dict[str, FusionMethod] = {
    "fedbens": fedbens,
    "fedavg": fedavg,
    "ensemble": ensemble,
    "fisher-merge": fisher_merge,
    "product": product,
    "fedfisher": fedfisher,
    "regmean": regmean,
    "fedbe": fedbe,
    "swag": swag_ensemble,
}


def fuse(client_paths: list[str | os.PathLike], method: str, options: FusionOptions | None = None,
         val_path: str | os.PathLike | None = None, unlabeled_path: str | os.PathLike | None = None,
         log=lambda msg: None, robust: bool = False, max_memory: int | None = None,
         tune: tuple[str, ...] = (), tune_temperatures=None, tune_prior_vars=None,
         ) -> tuple[FusionInputs, FusionResult, dict]:
    """Validate every client artifact, run ``method`` and return ``(inputs, result, metadata)``.

    Headers are checked and the memory need estimated first (refused above ``max_memory``
    bytes, default 80% of available memory); then the artifacts are loaded and, with
    ``robust``, outlying clients are screened out (:mod:`posterior_fusion.fusion.robust`).
    ``metadata`` holds the method, all hyper-parameters, the history, the screening report and
    the provenance (path and sha256 of each client artifact) for the global artifact.
    ``tune`` ("T" and/or "prior") selects T / σ0² on the validation data over a grid
    (:mod:`posterior_fusion.fusion.tuning`).
    """
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    options = options or FusionOptions()
    options.validate()
    if not client_paths:
        raise IncompatibleArtifactsError("no client artifacts given")
    headers = [declared_bytes(p) for p in client_paths]
    for p, h in zip(client_paths, headers):
        if h["kind"] != "client":
            raise SchemaError(str(p), "expected a client artifact (from fit-local), got a global one", "/")
    need = estimate_fuse_bytes(headers, method, options.modes)
    limit = max_memory if max_memory is not None else default_limit()
    if limit is not None and need > limit:
        raise ResourceLimitError(f"fusing these {len(headers)} artifacts with {method} needs about "
                                 f"{need / 2**30:.2f} GiB, over the limit of {limit / 2**30:.2f} GiB "
                                 "(--max-memory, default 80% of available memory)")
    clients = [load_client(p) for p in client_paths]
    k = clients[0].model_spec.num_classes
    val = read_silo(val_path, num_classes=k) if val_path else None
    unlabeled = read_silo(unlabeled_path, num_classes=k) if unlabeled_path else None
    if tune:
        if robust:
            clients, _ = screen_clients(clients)
        grids = {k: v for k, v in (("temperatures", tune_temperatures), ("prior_vars", tune_prior_vars)) if v}
        inputs, result, metadata = tune_fusion(clients, method, options, val, tune, log=log, **grids)
    else:
        inputs, result, metadata = fuse_clients(clients, method, options, val, unlabeled, log, robust)
    metadata["memory_estimate_bytes"] = need
    if val is not None:
        metadata["validation"] = {"file": str(val_path), "sha256": val.sha256(), "n": len(val)}
    return inputs, result, metadata


def fuse_clients(clients: list[ClientPosterior], method: str, options: FusionOptions | None = None,
                 val: SiloData | None = None, unlabeled: SiloData | None = None, log=lambda msg: None,
                 robust: bool = False) -> tuple[FusionInputs, FusionResult, dict]:
    """:func:`fuse` on already-loaded clients (e.g. subsets of components for an ablation)."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    options = options or FusionOptions()
    options.validate()
    check_compatible(clients)
    screening = None
    if robust:
        clients, screening = screen_clients(clients)
        for row in screening:
            if row["excluded"]:
                log(f"robust: excluding {row['file']}: {'; '.join(row['reasons'])}")
        check_compatible(clients)
    inputs = FusionInputs(clients, options, val, unlabeled)
    log(f"fusing {len(clients)} clients with {method} ({clients[0].structure}, M={clients[0].num_components})")
    t0 = time.perf_counter()
    result = METHODS[method](inputs)
    seconds = time.perf_counter() - t0
    metadata = {
        "method": method, "options": asdict(options), "fuse_seconds": round(seconds, 3),
        "temperature_used": [inputs.temperature(c) for c in clients],
        "prior_precision_used": [inputs.prior_precision(c) for c in clients],
        "server_prior_precision": inputs.server_prior_precision(),
        "structure": clients[0].structure, "screening": screening,
        "provenance": [{"file": c.path, "sha256": c.sha256, "n_data": c.n_data} for c in clients],
        "validation": None if val is None else {"sha256": val.sha256(), "n": len(val)},
        **dict(result.info.items()),
    }
    return inputs, result, metadata
