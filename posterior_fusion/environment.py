"""The environment variables the product reads, declared once (:class:`Environment`, with :func:`setting`), and
the one function that reads them (:func:`environment`): a variable that is unset takes its declared default, a
set one is converted and checked as every other setting is (one :class:`~posterior_fusion.errors.ConfigError`
line naming it). Torch-free: the progress display and the memory budget read them before anything else."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posterior_fusion.choices import Choice, Kernel
from posterior_fusion.settings import check_declared, convert, setting


class Malloc(Choice):
    """glibc's allocator policy."""

    KEEP = "keep", ("freed buffers of up to 1 GiB kept for reuse (training and fusion loops then do not fault them "
                    "in again)")
    DEFAULT = "default", "glibc's own behaviour"


@dataclass(frozen=True)
class Environment:
    PFUSE_PROGRESS: bool = setting(True, "Progress display on stderr (bars on a terminal, a line every 5 s "
                                         "otherwise); 0 turns it off, as `pfuse -q` does.")
    PFUSE_MAX_MEMORY: str | None = setting(None, "The memory limit of every reader and command, e.g. 8G (as "
                                                 "--max-memory); unset: 80% of MemAvailable.")
    PFUSE_KERNEL: str | None = setting(None, "Force the batched Kronecker kernels' backend; unset: torch, or what "
                                             "the caller names.", choices=Kernel)
    PFUSE_MALLOC: str = setting("keep", "glibc's allocator policy.", choices=Malloc)


def _declared(name: str) -> dataclasses.Field:
    """The declaration of the variable ``name``; KeyError for a name nobody declared (a programming error)."""
    for f in dataclasses.fields(Environment):
        if f.name == name:
            return f
    raise KeyError(f"{name} is not a declared environment variable (posterior_fusion.environment)")


def environment(name: str) -> Any:
    """The value of the declared variable ``name``: its default where unset or empty, else the text converted to
    its declared type and checked against its choices."""
    declared = _declared(name)
    text = os.environ.get(name, "").strip()
    if not text:
        return declared.default
    value = convert(text, typing.get_type_hints(Environment)[name], name, "environment")
    if isinstance(value, str) and declared.metadata.get("choices"):
        value = value.lower()
    check_declared(dataclasses.replace(Environment(), **{name: value}), "environment")
    return value


def override(name: str, text: str) -> Callable[[], None]:
    """Set the declared variable ``name`` to ``text`` for now; returns the function that puts back what was there
    (``pfuse -q`` silences progress for its own invocation only, in a process that calls it in process too)."""
    _declared(name)
    before = os.environ.get(name)
    os.environ[name] = text

    def restore() -> None:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before

    return restore
