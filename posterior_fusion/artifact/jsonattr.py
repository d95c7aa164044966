"""Strict JSON of artifact attributes, torch-free (``pfuse inspect`` reads headers before torch loads).

Every header value is parsed here: no NaN/Infinity, integers of bounded size, bounded nesting.
A failed check raises :class:`HeaderProblem` (the HDF5 path and what is wrong).
"""

from __future__ import annotations

import json
import math
from typing import Any

from posterior_fusion import ranges
from posterior_fusion.artifact import schema


class HeaderProblem(Exception):
    """A header value breaks the schema at ``where``."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where
        self.message = message


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed in JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to infinity
        raise ValueError(f"number {text[:30]} overflows to infinity")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > schema.MAX_JSON_INT_DIGITS:
        raise ValueError(f"integer with more than {schema.MAX_JSON_INT_DIGITS} digits")
    return int(text)


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, stopping at ``limit + 1``."""
    stack, deepest = [(obj, 1)], 0
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, d + 1) for c in children)
    return deepest


def parse_json(text: str, where: str, name: str) -> Any:
    """Strict JSON: no NaN/Infinity, integers of bounded size, bounded nesting depth."""
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_int=_bounded_int, parse_float=_finite_float)
    except RecursionError:
        raise HeaderProblem(where, f"attribute {name!r} is nested deeper than {schema.MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise HeaderProblem(where, f"attribute {name!r} is not valid JSON ({exc.msg})") from None
    except ValueError as exc:
        raise HeaderProblem(where, f"attribute {name!r}: {exc}") from None
    if _depth(obj, schema.MAX_JSON_DEPTH) > schema.MAX_JSON_DEPTH:
        raise HeaderProblem(where, f"attribute {name!r} is nested deeper than {schema.MAX_JSON_DEPTH} levels")
    return obj


def _is_int(v: Any) -> bool:
    return ranges.is_int(v)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v if isinstance(v, float) else float(min(max(v, -1e300), 1e300))))


