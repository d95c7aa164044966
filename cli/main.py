"""``pfuse`` entry point: registers the commands; each lives in its own module."""

from __future__ import annotations

import sys

import click

from posterior_fusion import __version__
from posterior_fusion.cli.data_commands import import_data_cmd, partition
from posterior_fusion.cli.experiment_commands import experiment_cmd
from posterior_fusion.cli.inspect_commands import inspect_cmd
from posterior_fusion.cli.local_commands import fit_local_cmd, init
from posterior_fusion.cli.server_commands import demo_cmd, evaluate_cmd, fuse_cmd, predict_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="pfuse")
def pfuse() -> None:
    """posterior-fusion: one-shot federated learning by Bayesian posterior fusion.

    Typical flow: partition -> fit-local (each silo) -> fuse (server) -> evaluate.
    """


for command in (import_data_cmd, partition, init, fit_local_cmd, fuse_cmd, evaluate_cmd, predict_cmd, inspect_cmd, demo_cmd,
                experiment_cmd):
    pfuse.add_command(command)


def main() -> None:
    """Console entry point: usage errors are one ``error:`` line with exit code 2, like every other error."""
    try:
        pfuse(standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(2)
    except click.ClickException as exc:
        where = f" ({exc.ctx.command_path})" if getattr(exc, "ctx", None) else ""
        click.echo(f"error: {exc.format_message()}{where}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
