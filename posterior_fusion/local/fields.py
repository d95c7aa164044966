"""How a fit setting is declared: a dataclass field with its help text (and, where it has them,
its choices). Declared once on the config records (:mod:`.config`, :mod:`.ppd`); the command-line
options of ``fit-local``, the Flower run-config keys and the experiment TOML's ``[fit]`` table
are derived from these declarations (:func:`posterior_fusion.local.config.fit_settings`)."""

from __future__ import annotations

import dataclasses
from typing import Any


def fit_field(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:  # noqa: A002
    """A fit setting: ``default``, one line of ``help`` (shown by ``fit-local --help``) and, for a
    text setting, its ``choices``."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})
