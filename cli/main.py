"""``pfuse`` entry point: a lazy command group. Each command lives in its own module, imported
only when that command runs, so ``pfuse --help`` starts without importing torch."""

from __future__ import annotations

import importlib
import sys
import typing
import warnings

import click

from posterior_fusion import __version__
from posterior_fusion.cli.common import as_flags, say
from posterior_fusion.environment import override
from posterior_fusion.runtime import keep_freed_memory

# name -> (module, attribute, one-line help shown by `pfuse --help`)
COMMANDS = {
    "import-data": ("data_commands", "import_data_cmd", "Convert a data set into a posterior-fusion data file."),
    "partition": ("data_commands", "partition", "Split a data set into non-IID silos, server validation and test files."),
    "init": ("local_commands", "init", "Write M shared starting points that every client trains from."),
    "fit-local": ("local_commands", "fit_local_cmd", "Train M models on one silo and write their local posteriors."),
    "recapture": ("local_commands", "recapture_cmd", "Capture another curvature structure for an artifact's trained components."),
    "refresh": ("local_commands", "refresh_cmd", "Re-expand a silo's own artifact at a fused global's members (refresh round)."),
    "fuse": ("server_commands", "fuse_cmd", "Validate client artifacts and fuse them into a global posterior."),
    "evaluate": ("server_commands", "evaluate_cmd", "Accuracy, NLL, calibration and uncertainty metrics of global artifacts."),
    "predict": ("server_commands", "predict_cmd", "Write predictive class probabilities (map, mc or glm)."),
    "export": ("export_commands", "export_cmd", "Write one network of a global artifact as safetensors + its spec."),
    "inspect": ("inspect_commands", "inspect_cmd", "Validate an artifact and summarise it."),
    "audit": ("local_commands", "audit_cmd", "What a client artifact reveals about its silo (labels, inputs, membership)."),
    "demo": ("demo_commands", "demo_cmd", "Partition -> fit-local -> fuse with every method -> table."),
    "experiment": ("experiment_commands", "experiment_cmd", "Run or resume a cached grid of experiments."),
}


class LazyGroup(click.Group):
    def main(self, *args: typing.Any, standalone_mode: bool = True, **kwargs: typing.Any) -> typing.Any:
        """Standalone (the console, ``CliRunner``): a usage error is one ``error:`` line, exit 2."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        one_line_usage_errors(lambda: super(LazyGroup, self).main(*args, standalone_mode=False, **kwargs))

    def resolve_command(self, ctx: click.Context, args: list[str]):
        """The command after old spellings are rewritten (:func:`posterior_fusion.compat.renamed_command`);
        ``-q`` / ``--quiet`` after the command means what it means before it."""
        from posterior_fusion.compat import renamed_command

        args = renamed_command(list(args), lambda m: say(m, err=True))
        if any(a in ("-q", "--quiet") for a in args[1:]):
            ctx.call_on_close(override("PFUSE_PROGRESS", "0"))
            args = [args[0], *[a for a in args[1:] if a not in ("-q", "--quiet")]]
        return super().resolve_command(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(f"posterior_fusion.cli.{module}"), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, (_, _, text) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="pfuse")
@click.option("--quiet", "-q", is_flag=True, help="No progress display (bars on a terminal, a line every 5 s otherwise).")
def pfuse(quiet: bool) -> None:
    """posterior-fusion: one-shot federated learning by Bayesian posterior fusion.

    Typical flow: partition -> fit-local (each silo) -> fuse (server) -> evaluate.

    Freed memory is kept for reuse (glibc mallopt: training and fusion loops then do not fault
    their buffers in again every step); PFUSE_MALLOC=default turns that off.
    """
    keep_freed_memory()
    warnings.showwarning = one_line_warning
    if quiet:  # for this invocation only: a process that calls pfuse in process keeps its own setting afterwards
        click.get_current_context().call_on_close(override("PFUSE_PROGRESS", "0"))


def one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one ``warning:`` line on stderr (no source line, no category path)."""
    text = str(message).strip().splitlines()
    say(f"warning: {as_flags(text[0]) if text else category.__name__}", err=True)  # settings named as the CLI's flags


def main() -> None:
    """Console entry point: usage errors are one ``error:`` line with exit code 2, like every other error."""
    pfuse.main()


def one_line_usage_errors(run) -> None:
    """``run()`` (the group's non-standalone main), with click's usage errors as one ``error:`` line and
    its exit codes as the process's."""
    try:
        code = run()
        sys.exit(code if isinstance(code, int) else 0)
    except click.exceptions.NoArgsIsHelpError as exc:
        say(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(2)
    except click.ClickException as exc:
        where = f" ({exc.ctx.command_path})" if getattr(exc, "ctx", None) else ""
        say(f"error: {exc.format_message()}{where}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        say("error: interrupted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
