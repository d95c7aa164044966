"""The explicit registry of fusion methods: name -> :class:`FusionMethod` (function + settings record).

Adding a method: write its module (function, settings record, ``METHOD``) and add one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.methods import (
    ensemble,
    fedavg,
    fedbe,
    fedbens,
    fedfisher,
    fedlpa,
    fedppd,
    fisher_merge,
    hbfl,
    product,
    regmean,
    swag,
    swag_product,
)
from posterior_fusion.fusion.types import FusionMethod

METHODS: dict[str, FusionMethod] = {m.name: m for m in (
    fedbens.METHOD,
    fedavg.METHOD,
    ensemble.METHOD,
    fisher_merge.METHOD,
    product.METHOD,
    hbfl.METHOD,
    fedfisher.METHOD,
    regmean.METHOD,
    fedlpa.METHOD,
    fedbe.METHOD,
    swag.METHOD,
    swag_product.METHOD,
    fedppd.METHOD,
    fedppd.DISTILL_METHOD,
)}


# What runs when no method is named (``pfuse fuse``, the Flower app, ``fuse()``): the default row of
# docs/choosing.md — the client ensemble pooled under label shift, which needs no validation or unlabeled
# server data and was best at every heterogeneity measured (how it was chosen: that page).
DEFAULT_METHOD = ensemble.METHOD.name
DEFAULT_SETTINGS: Mapping[str, str] = MappingProxyType({"pooling": "label-shift"})
# The method of the grid report's accuracy-against-M plot (a method whose members are M fused modes).
MODES_METHOD = fedbens.METHOD.name
# The side-by-side comparisons the grids and the demo run by default (names declared here only).
COMPARED = tuple(m.name for m in (fedbens.METHOD, fedfisher.METHOD, regmean.METHOD, fisher_merge.METHOD,
                                  fedavg.METHOD))
DEMO = (*COMPARED, product.METHOD.name, fedbe.METHOD.name, swag.METHOD.name, ensemble.METHOD.name)
QUICK = (fedbens.METHOD.name, fedavg.METHOD.name)


def resolve_default(method: str | None, settings: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """``(method, settings)`` with :data:`DEFAULT_METHOD` and :data:`DEFAULT_SETTINGS` under the given
    settings where no method was named."""
    if method is not None:
        return method, dict(settings or {})
    return DEFAULT_METHOD, {**DEFAULT_SETTINGS, **(settings or {})}


def get_method(name: str) -> FusionMethod:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]
