"""Per-method settings records: each fusion method declares a small frozen dataclass of its
own hyper-parameters beside itself (posteriors-style: the settings are the method's
arguments). This module parses ``key=value`` pairs (CLI ``--set``, TOML tables, Flower run
config) into such a record, checking names and types against it, and describes a record
for ``pfuse fuse --help-method``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from posterior_fusion import ranges
from posterior_fusion.errors import ConfigError

S = TypeVar("S", bound="MethodSettings")


def setting(default: Any, help: str, bounds: tuple[float, float] | None = None) -> Any:  # noqa: A002
    """A settings field with its help text (shown by ``--help-method``) and, for a number, its
    accepted range ``bounds`` (inclusive; every int and float setting declares one)."""
    return dataclasses.field(default=default, metadata={"help": help, "bounds": bounds})


@dataclass(frozen=True)
class MethodSettings:
    """Base of every method's settings record (a method without settings uses it as is).

    ``renamed``: old setting name -> its name now, so a configuration written for an earlier version is
    refused with the new name rather than with a bare "no setting"."""

    renamed: ClassVar[dict[str, str]] = {}

    def validate(self) -> None:
        """Raise :class:`ConfigError` for values out of range (override per method)."""

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        return typing.get_type_hints(cls)

    @classmethod
    def from_mapping(cls: type[S], values: Mapping[str, Any], method: str = "") -> S:
        """Build and validate a record from ``values`` (strings are converted by field type)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        moved = [f"{old!r} is now {cls.renamed[old]!r}" for old in unknown if old in cls.renamed]
        if moved:
            raise ConfigError(f"method {method!r}: setting {'; '.join(moved)}")
        if unknown:
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"method {method!r} has no setting {', '.join(map(repr, unknown))}; its settings: {known}")
        hints = cls.field_types()
        out = cls(**{k: _convert(v, hints[k], k, method) for k, v in values.items()})
        for f in dataclasses.fields(cls):
            value, bounds = getattr(out, f.name), f.metadata.get("bounds")
            if bounds is not None and value is not None and not isinstance(value, (bool, str)):
                ranges.check(f"{method} setting {f.name!r}" if method else f"setting {f.name!r}", value, bounds)
        out.validate()
        return out

    def with_overrides(self: S, values: Mapping[str, Any], method: str = "") -> S:
        """A copy with ``values`` applied (same checks as :meth:`from_mapping`)."""
        return type(self).from_mapping({**dataclasses.asdict(self), **values}, method)

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """``[{name, type, default, help}]`` for every field."""
        hints = cls.field_types()
        return [{"name": f.name, "type": _type_name(hints[f.name]), "default": f.default,
                 "help": f.metadata.get("help", ""), "bounds": f.metadata.get("bounds")}
                for f in dataclasses.fields(cls)]


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if args:
        return " | ".join("None" if a is type(None) else a.__name__ for a in args)
    return tp.__name__


def _convert(value: Any, tp: Any, key: str, method: str) -> Any:
    args = typing.get_args(tp)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if args else tp
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "")):
        if optional:
            return None
        raise ConfigError(f"{method} setting {key!r} needs a value")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text in ("true", "1", "yes")
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
            return out
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{method} setting {key!r} must be {_type_name(tp)}, got {str(value)[:40]!r}") from None


def parse_pairs(pairs: list[str] | tuple[str, ...], option: str = "--set") -> dict[str, str]:
    """``["steps=100", "adam_lr=0.01"]`` -> ``{"steps": "100", "adam_lr": "0.01"}``."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{option} takes key=value, got {pair!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out
