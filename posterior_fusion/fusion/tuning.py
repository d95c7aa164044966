"""Server-side tuning of temperature T and prior variance σ0² (no client involved).

Artifacts hold the raw GGN, so the server can re-temper every client posterior
(``Λ = G / T + λ0 I``) and refit the fusion for each point of a small grid, keeping the one
whose ensemble has the best accuracy on the server's validation split (ties: lower NLL).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.from_posteriors import fuse_clients
from posterior_fusion.fusion.options import FusionOptions
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.metrics import evaluate_members

TUNE_TEMPERATURES = (0.01, 0.03, 0.1, 0.3, 1.0)
TUNE_PRIOR_VARS = (0.01, 0.1, 1.0)
TUNABLE = ("T", "prior")


def parse_tune(text: str | None) -> tuple[str, ...]:
    """'T', 'prior' or 'T,prior' -> tuple of names."""
    if not text:
        return ()
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in TUNABLE]
    if bad or not names:
        raise ConfigError(f"`tune` takes a comma list of {TUNABLE}, got {text!r}")
    return names


def tune_fusion(clients: list[ClientPosterior], method: str, options: FusionOptions, val: SiloData | None,
                params: tuple[str, ...], temperatures=TUNE_TEMPERATURES, prior_vars=TUNE_PRIOR_VARS,
                log=lambda msg: None, settings: MethodSettings | Mapping[str, Any] | None = None):
    """Run ``method`` over the grid and return the best ``(inputs, result, metadata)``."""
    if val is None:
        raise ConfigError("`tune` needs server validation data (`val`)")
    ts = list(temperatures) if "T" in params else [options.temperature]
    pvs = list(prior_vars) if "prior" in params else [options.prior_var]
    table, best = [], None
    for t, pv in itertools.product(ts, pvs):
        run = fuse_clients(clients, method, replace(options, temperature=t, prior_var=pv), settings, val)
        m = evaluate_members(run[0].spec, run[1].members, val, weights=run[1].mode_weights,
                             pooling=run[1].pooling(run[0].spec.num_classes))
        row = {"temperature": t, "prior_var": pv, "val_accuracy": m["accuracy"], "val_nll": m["nll"]}
        table.append(row)
        log(f"tune: T={t} prior_var={pv}: val accuracy {m['accuracy']:.4f} NLL {m['nll']:.4f}")
        if best is None or (m["accuracy"], -m["nll"]) > (best[0]["val_accuracy"], -best[0]["val_nll"]):
            best = (row, run)
    row, (inputs, result, metadata) = best
    edges = [f"{name} = {row[key]:g}, the {'lowest' if row[key] == min(grid) else 'highest'} of its grid "
             f"({', '.join(f'{v:g}' for v in grid)})"
             for name, key, grid in (("T", "temperature", ts), ("prior_var", "prior_var", pvs))
             if len(grid) > 1 and row[key] in (min(grid), max(grid))]
    if edges:
        warnings.warn(f"tune: the best point lies at the edge of its grid: {'; '.join(edges)}; the optimum may lie "
                      "beyond it (widen the grid: `tune_temperatures`, `tune_prior_vars`)", stacklevel=2)
    metadata["tuning"] = {"chosen": row, "grid": table, "at_grid_edge": bool(edges)}
    return inputs, result, metadata
