"""The explicit registry of fusion methods: name -> :class:`~posterior_fusion.fusion.method_type.FusionMethod`
(function + settings record), each name declared here beside the module that defines it.

A method's module is imported when its entry is first read, so listing the names (``pfuse fuse
--help``, a TOML check) imports no torch. Adding a method: write its module (function, settings record,
``METHOD``) and add one line to :data:`MODULES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, MutableMapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from posterior_fusion.errors import ConfigError

if TYPE_CHECKING:
    from posterior_fusion.fusion.method_type import FusionMethod

MODULES: Mapping[str, str] = MappingProxyType({  # name -> its module under posterior_fusion.fusion.methods
    "fedbens": "fedbens",
    "fedavg": "fedavg",
    "ensemble": "ensemble",
    "fisher-merge": "fisher_merge",
    "product": "product",
    "hbfl": "hbfl",
    "fedfisher": "fedfisher",
    "regmean": "regmean",
    "fedlpa": "fedlpa",
    "fedbe": "fedbe",
    "swag": "swag",
    "swag-product": "swag_product",
    "fedppd": "fedppd",
    "fedppd-distill": "fedppd",
})


class Registry(MutableMapping):
    """``name -> FusionMethod`` over :data:`MODULES`: the names are known at once, an entry is imported
    from its module (the ``FusionMethod`` of that name it declares) when first read. Entries may be
    added (a test's method) like a dict's."""

    def __init__(self, modules: Mapping[str, str]) -> None:
        self._entries: dict[str, FusionMethod | str] = dict(modules)

    def __getitem__(self, name: str) -> FusionMethod:
        entry = self._entries[name]
        if isinstance(entry, str):
            from posterior_fusion.fusion.method_type import FusionMethod

            module = importlib.import_module(f"posterior_fusion.fusion.methods.{entry}")
            found = [m for m in vars(module).values() if isinstance(m, FusionMethod) and m.name == name]
            if len(found) != 1:
                raise RuntimeError(f"posterior_fusion.fusion.methods.{entry} declares no method {name!r}")
            entry = self._entries[name] = found[0]
        return entry

    def __setitem__(self, name: str, method: FusionMethod) -> None:
        self._entries[name] = method

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:  # a name's presence imports nothing
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({list(self._entries)})"


METHODS = Registry(MODULES)

# What runs when no method is named (``pfuse fuse``, the Flower app, ``fuse()``): the default row of
# docs/choosing.md — the client ensemble pooled under label shift, which needs no validation or unlabeled
# server data and was best at every heterogeneity measured (how it was chosen: that page).
DEFAULT_METHOD = "ensemble"
DEFAULT_SETTINGS: Mapping[str, str] = MappingProxyType({"pooling": "label-shift"})
# The method of the grid report's accuracy-against-M plot (a method whose members are M fused modes).
MODES_METHOD = "fedbens"
# The side-by-side comparisons the grids and the demo run by default (names declared here only).
COMPARED = ("fedbens", "fedfisher", "regmean", "fisher-merge", "fedavg")
DEMO = (*COMPARED, "product", "fedbe", "swag", "ensemble")
QUICK = ("fedbens", "fedavg")


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
