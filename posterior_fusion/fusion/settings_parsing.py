"""Per-method settings records: each fusion method declares a small frozen dataclass of its
own hyper-parameters beside itself (posteriors-style: the settings are the method's
arguments), with :func:`posterior_fusion.settings.setting` — the one declaration every setting
of the product uses. This module parses ``key=value`` pairs (CLI ``--set``, TOML tables, Flower
run config) into such a record, checking names, types, bounds and choices against it, and
describes a record for ``pfuse fuse --help-method``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from posterior_fusion.compat import RENAMED_METHOD_SETTINGS
from posterior_fusion.errors import ConfigError
from posterior_fusion.settings import check_declared, convert, describe, setting

__all__ = ["MethodSettings", "parse_pairs", "setting"]

S = TypeVar("S", bound="MethodSettings")


@dataclass(frozen=True)
class MethodSettings:
    """Base of every method's settings record (a method without settings uses it as is)."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a value outside its declared bounds or choices; a method adds
        the combinations of values that do not go together (calling this first)."""
        check_declared(self)

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        return typing.get_type_hints(cls)

    @classmethod
    def from_mapping(cls: type[S], values: Mapping[str, Any], method: str = "") -> S:
        """Build and validate a record from ``values`` (strings are converted by field type)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        moved = [f"{old!r} is now {RENAMED_METHOD_SETTINGS[old]!r}" for old in unknown
                 if RENAMED_METHOD_SETTINGS.get(old) in fields]
        if moved:
            raise ConfigError(f"method {method!r}: setting {'; '.join(moved)}")
        if unknown:
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"method {method!r} has no setting {', '.join(map(repr, unknown))}; its settings: {known}")
        hints = cls.field_types()
        out = cls(**{k: convert(v, hints[k], k, method) for k, v in values.items()})
        check_declared(out, method)
        out.validate()
        return out

    def with_overrides(self: S, values: Mapping[str, Any], method: str = "") -> S:
        """A copy with ``values`` applied (same checks as :meth:`from_mapping`)."""
        return type(self).from_mapping({**dataclasses.asdict(self), **values}, method)

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """``[{name, type, default, help, bounds, choices}]`` for every field."""
        return describe(cls)


def parse_pairs(pairs: list[str] | tuple[str, ...], option: str = "--set") -> dict[str, str]:
    """``["steps=100", "adam_lr=0.01"]`` -> ``{"steps": "100", "adam_lr": "0.01"}``."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{option} takes key=value, got {pair!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out
