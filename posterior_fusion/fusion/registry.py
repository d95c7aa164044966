"""The explicit registry of fusion methods: name -> :class:`FusionMethod` (function + settings record).

Adding a method: write its module (function, settings record, ``METHOD``) and add one line here.
"""

from __future__ import annotations

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


DEFAULT_METHOD = fedbens.METHOD.name
# The side-by-side comparisons the grids and the demo run by default (names declared here only).
COMPARED = tuple(m.name for m in (fedbens.METHOD, fedfisher.METHOD, regmean.METHOD, fisher_merge.METHOD,
                                  fedavg.METHOD))
DEMO = (*COMPARED, product.METHOD.name, fedbe.METHOD.name, swag.METHOD.name, ensemble.METHOD.name)
QUICK = (fedbens.METHOD.name, fedavg.METHOD.name)


def get_method(name: str) -> FusionMethod:
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return METHODS[name]
