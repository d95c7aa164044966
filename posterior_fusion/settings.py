"""One way to declare a setting, one way to read it.

Every setting the product has — a fusion method's (``--set``), a silo's fit settings
(``fit-local``'s options, the experiment TOML's ``[fit]`` table, the Flower run config) — is a field
of a frozen dataclass declared with :func:`setting`: its default, one line of help, and where it
has them its accepted ``bounds`` (numbers) or ``choices`` (text). :func:`convert` turns a value
given as text (command line, TOML, Flower) into the field's type with one rule for every caller:
booleans are ``true/false/1/0/yes/no`` and nothing else, numbers must be finite, ``None`` only where
the field is optional. :func:`check_declared` applies the declared bounds and choices. Old names
live in :mod:`posterior_fusion.compat`, nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Mapping
from typing import Any

from posterior_fusion import ranges
from posterior_fusion.choices import Choice
from posterior_fusion.errors import ConfigError

TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")


def setting(default: Any, help: str, bounds: tuple[float, float] | None = None,  # noqa: A002
            choices: type[Choice] | tuple[Choice, ...] | None = None) -> Any:
    """A settings field: ``default``, one line of ``help`` (shown by ``--help`` / ``--help-method``),
    for a number its inclusive ``bounds``, for a text its ``choices`` — a :class:`~posterior_fusion.choices.Choice`
    enum, or some of its members, each value with its one-line doc. A list or table default is copied for
    every record."""
    members = tuple(choices) if choices is not None else None
    if members is not None and not all(isinstance(m, Choice) for m in members):
        raise TypeError("setting(choices=...) takes a Choice enum or its members (a one-line doc per value)")
    metadata = {"help": help, "bounds": bounds,
                "choices": tuple(m.value for m in members) if members else None,
                "choice_docs": {m.value: m.doc for m in members} if members else None}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: json.loads(json.dumps(default)), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def choice_help(docs: dict[str, str] | None) -> str:
    """`` Values: a: its doc; b: its doc.`` for a field's help, or ``""`` without choices."""
    return " Values: " + "; ".join(f"{v}: {d}" for v, d in docs.items()) + "." if docs else ""


def type_name(tp: Any) -> str:
    """``int``, ``float | None``, … for messages and ``--help-method``."""
    args = typing.get_args(tp)
    if args:
        return " | ".join("None" if a is type(None) else a.__name__ for a in args)
    return getattr(tp, "__name__", str(tp))


def base_type(tp: Any) -> Any:
    """The type of an optional field without its ``None``."""
    args = typing.get_args(tp)
    return next((a for a in args if a is not type(None)), tp) if args else tp


def convert(value: Any, tp: Any, name: str, where: str = "") -> Any:
    """``value`` (text from a command line, TOML or Flower, or already typed) as a ``tp`` field's value.

    Raises :class:`ConfigError` naming ``where`` and ``name`` for anything it cannot read exactly —
    ``"ture"`` for a boolean, ``1.5`` for an integer, ``inf`` for a float."""
    optional = type(None) in typing.get_args(tp)
    base = base_type(tp)
    label = f"{where} setting {name!r}" if where else f"setting {name!r}"
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("none", "")):
        if optional:
            return None
        raise ConfigError(f"{label} needs a value")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            text = str(value).strip().lower()
            if text not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError
            return text in TRUE_WORDS
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
        if base is dict:
            out = json.loads(value) if isinstance(value, str) else dict(value)
            if not isinstance(out, dict):
                raise ValueError
            return out
        if base is str:
            return str(value)
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"{label} must be {type_name(tp)}, got {str(value)[:40]!r}") from None


def check_declared(record: Any, where: str = "", prefix: str = "", dashed: bool = False) -> None:
    """Refuse (one :class:`ConfigError` line) a field of ``record`` outside its declared ``bounds``
    or ``choices``; ``prefix``: what the record's settings are called by outside it (``ppd_`` for
    FedPPD's), so the message names the setting (and the CLI its flag) as the user wrote it; ``dashed``: the
    names as a Flower run config spells them (``min-nodes``)."""
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        bounds, choices = f.metadata.get("bounds"), f.metadata.get("choices")
        name = prefix + f.name
        name = name.replace("_", "-") if dashed else name
        if value is None or isinstance(value, bool):
            continue
        if bounds is not None and not isinstance(value, str):
            ranges.check(f"{where} setting {name!r}" if where else name, value, bounds)
        if choices is not None and value not in choices:
            label = f"{where} setting {name}" if where else f"setting {name}"
            raise ConfigError(f"{label} must be one of {', '.join(choices)}; got {str(value)[:40]!r}")


def describe(cls: type) -> list[dict[str, Any]]:
    """``[{name, type, default, help, bounds, choices, choice_docs}]`` for every declared field of ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        default = field_default(f)
        out.append({"name": f.name, "type": type_name(hints[f.name]), "default": default,
                    "help": f.metadata["help"], "bounds": f.metadata.get("bounds"),
                    "choices": f.metadata.get("choices"), "choice_docs": f.metadata.get("choice_docs")})
    return out


def from_run_config(cls: type, cfg: Mapping[str, Any], prefix: str = "", where: str = "run config") -> Any:
    """A settings record ``cls`` from a flat Flower run config whose keys spell its fields with ``-`` for ``_``
    after ``prefix`` (``secure-aggregation-`` + ``max-weight``): each present key converted to its declared type,
    the rest at their defaults, then bounds and choices checked (one :class:`ConfigError` line naming the key).
    Other keys are left to their own readers; ``where``: what the messages call ``cfg`` (a node config)."""
    hints = typing.get_type_hints(cls)
    values = {name: convert(v, hints[name], prefix + name.replace("_", "-"), where)
              for name, v in given_in_run_config(cls, cfg, prefix).items()}
    out = cls(**values)
    check_declared(out, where, prefix=prefix.replace("-", "_"), dashed=True)
    return out


def given_in_run_config(cls: type, cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``field -> value as given`` for the fields of ``cls`` that the flat run config ``cfg`` holds (spelt
    ``prefix`` + the name with ``-`` for ``_``), unconverted: for a record whose given settings matter apart
    from its defaults (the distillation recipe's)."""
    return {f.name: cfg[key] for f in dataclasses.fields(cls) if (key := prefix + f.name.replace("_", "-")) in cfg}


def declared_default(cls: type, name: str) -> Any:
    """The default ``cls`` declares for its field ``name``: what a reader takes where a recorded value is absent,
    so that no module writes a setting's default a second time."""
    return field_default(next(f for f in dataclasses.fields(cls) if f.name == name))


def field_default(f: dataclasses.Field) -> Any:
    """A declared field's default (a fresh copy of a list or table default)."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def declared_help(cls: type, name: str) -> str:
    """The one line of help ``cls`` declares for its field ``name``: a record that reuses another's setting
    (a recapture's structure is a fit's) says it the same way."""
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == name)


def record_from(cls: type, values: Mapping[str, Any], where: str = "", prefix: str = "") -> Any:
    """A validated ``cls`` from the values of its fields that are given (``None``: at its declared default,
    for the options a command generates from ``cls``): each converted to its declared type, then the record's own
    ``validate`` where it has one, else its declared bounds and choices. Messages name a setting as
    ```<prefix><name>```, which the CLI shows as its flag."""
    hints = typing.get_type_hints(cls)
    given = {f.name: convert(values[f.name], hints[f.name], f"`{prefix}{f.name}`", where)
             for f in dataclasses.fields(cls) if values.get(f.name) is not None}
    out = cls(**given)
    if hasattr(out, "validate"):
        out.validate()
    else:
        check_declared(out, where, prefix=prefix)
    return out
