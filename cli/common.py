"""Shared CLI helpers: one-line errors, JSON output, deprecated spellings."""

from __future__ import annotations

import functools
import json
import re
import sys
import typing
from collections.abc import Callable
from typing import Any

import click

from posterior_fusion.compat import REMOVED_IN, RENAMED_OPTIONS
from posterior_fusion.environment import environment
from posterior_fusion.errors import PfuseError, terminal_safe

MAX_ERROR_CHARS = 2000
# The library names settings in backticks (`min_size`); the CLI shows their flags. A setting's flag
# is ``--`` + its name with ``-`` for ``_`` unless this table says otherwise.
FLAG_OF: dict[str, str] = {}
_SETTING = re.compile(r"`([a-z][a-z0-9_]*)`")


def as_flags(message: str) -> str:
    """``message`` with every `setting` written as its command-line flag (the one place they map)."""
    return _SETTING.sub(lambda m: FLAG_OF.get(m.group(1), "--" + m.group(1).replace("_", "-")), message)


def handle_errors(fn: Callable) -> Callable:
    """Turn library errors into ``error: <message>`` on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PfuseError as exc:
            # One line, whatever the message holds: newlines and control characters from a file
            # are escaped, and a huge string is cut.
            line = terminal_safe(as_flags(str(exc)).replace("\n", "\\n").replace("\t", " "), MAX_ERROR_CHARS)
            click.echo(f"error: {line}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    return wrapper


def say(text: str = "", err: bool = False) -> None:
    """Every line the CLI prints: control characters escaped, so a string read from a file (a
    name, a provider, a message) can never move the cursor, clear or recolour the screen."""
    click.echo(terminal_safe(text), err=err)


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def log_to_stderr(msg: str) -> None:
    """A progress or log line on stderr; nothing under ``pfuse --quiet`` (warnings go through
    :mod:`warnings`, printed whatever ``--quiet`` says)."""
    if environment("PFUSE_PROGRESS"):
        say(msg, err=True)


max_memory_option = click.option(
    "--max-memory", default=None,
    help="Refuse work estimated (from file headers, before loading) above this size, e.g. 8G "
         "[default: 80% of available memory, or $PFUSE_MAX_MEMORY].")


def old_spellings(command: str) -> Callable:
    """The deprecated spellings of ``command``'s options (:data:`posterior_fusion.compat.RENAMED_OPTIONS`),
    each accepted as a hidden option that warns and sets the new option's parameter."""
    types = {"int": int, "str": str, "float": float}

    def decorate(fn: Callable) -> Callable:
        for old, (new, target, type_name) in RENAMED_OPTIONS.get(command, {}).items():
            fn = renamed(old, new, target, type=types[type_name])(fn)
        return fn

    return decorate


def renamed(old: str, new: str, target: str, **option_kwargs: Any) -> Callable:
    """Keep ``old`` as a hidden, deprecated spelling of option ``new`` (parameter ``target``)
    until :data:`posterior_fusion.compat.REMOVED_IN`: using it prints a warning and sets ``target``."""
    dest = "deprecated_" + old.lstrip("-").replace("-", "_")

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = kwargs.pop(dest)
            if value is not None and value is not False:
                click.echo(f"warning: {old} is deprecated and will be removed in {REMOVED_IN}; use {new}", err=True)
                ctx = click.get_current_context()
                param = next((p for p in ctx.command.params if p.name == target), None)
                if param is not None:  # the new option's type, range included, checks the old spelling's value
                    value = param.type.convert(value, param, ctx)
                kwargs[target] = value
            return fn(*args, **kwargs)

        return click.option(old, dest, hidden=True, default=None, **option_kwargs)(wrapper)

    return decorate


def bounded(bounds: tuple[float, float], kind: type = int) -> click.ParamType:
    """A click type for a number in ``bounds`` (inclusive; one of :mod:`posterior_fusion.ranges`): refused
    before the command runs, one line naming the option; ``--help`` shows the range."""
    lo, hi = bounds
    return click.IntRange(int(lo), int(hi)) if kind is int else FiniteFloatRange(float(lo), float(hi))


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses NaN (which compares false with both ends)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if rv != rv:
            self.fail(f"{value!r} is not a number in the range {self._describe_range()}.", param, ctx)
        return rv


def declared_option(fn: Callable, name: str, kind: type, default: Any, help_text: str, *,
                    choices: tuple[str, ...] | None = None, choice_docs: dict[str, str] | None = None,
                    bounds: tuple[float, float] | None = None, text: bool = False,
                    metavar: str | None = None) -> Callable:
    """``fn`` with the option ``--<name>`` (destination ``name``) of one declared setting: a flag for a boolean,
    a choice (each value's doc in the help), a number in its bounds, else ``kind`` (a table as JSON text).
    ``text``: read as given (default ``None``: the declaration's) by the settings converter, which also reads
    ``none``. The one place an option of a setting is built."""
    from posterior_fusion.settings import choice_help

    flag = "--" + name.replace("_", "-")
    help_text += choice_help(choice_docs)
    if kind is bool:
        return click.option(flag, name, is_flag=True, default=bool(default),
                            help=f"{help_text} [default: {'on' if default else 'off'}]")(fn)
    if "[default" not in help_text:
        help_text += f" [default: {'none' if default is None else json.dumps(default) if kind is dict else default}]"
    choice = click.Choice(choices) if choices else None
    if text:
        return click.option(flag, name, default=None, type=choice, metavar=None if choice else metavar,
                            help=help_text)(fn)
    number = bounded(bounds, kind) if bounds and kind in (int, float) else None
    return click.option(flag, name, default=json.dumps(default) if kind is dict else default,
                        type=choice or number or (str if kind is dict else kind), show_default=False,
                        help=help_text)(fn)


def setting_options(record: type, *, prefix: str = "", text: bool = False, help_prefix: str = "",
                    skip: tuple[str, ...] = (), metavar: str | None = None) -> Callable:
    """A decorator adding one option per declared field of ``record`` (:func:`posterior_fusion.settings.setting`:
    its default, help, bounds and choices), so that no option of a setting is written by hand: ``--<prefix>-<name>``
    with the destination ``<prefix>_<name>`` (:func:`declared_option`). ``skip``: fields that are not options."""
    from posterior_fusion.settings import base_type, describe

    hints = typing.get_type_hints(record)

    def decorate(fn: Callable) -> Callable:
        for row in reversed(describe(record)):
            if row["name"] not in skip:
                fn = declared_option(fn, (prefix + "_" if prefix else "") + row["name"],
                                     base_type(hints[row["name"]]), row["default"], help_prefix + row["help"],
                                     choices=row["choices"], choice_docs=row["choice_docs"], bounds=row["bounds"],
                                     text=text, metavar=metavar)
        return fn

    return decorate
