"""``pfuse experiment``."""

from __future__ import annotations

import json

import click

from posterior_fusion import ranges
from posterior_fusion.cli.common import bounded, handle_errors, log_to_stderr, old_spellings, say
from posterior_fusion.errors import ConfigError


class ExperimentCommand(click.Command):
    """``pfuse experiment``, whose ``--help`` ends with the config's keys as
    :class:`~posterior_fusion.experiment.grid_config.ExperimentConfig` declares them (help and default each)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from posterior_fusion.experiment.grid_config import ExperimentConfig
        from posterior_fusion.settings import choice_help, describe

        rows = [(r["name"], f"{r['help']}{choice_help(r['choice_docs'])} [default: {json.dumps(r['default'])}]")
                for r in describe(ExperimentConfig)]
        with formatter.section("Config keys (TOML)"):
            formatter.write_dl(rows)


@click.command("experiment", cls=ExperimentCommand)
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--out-dir", default=None, type=click.Path(file_okay=False),
              help="Cache and output folder [default: runs/<config name>].")
@click.option("--jobs", default=1, show_default=True, type=bounded(ranges.JOBS), help="Parallel fit-local processes.")
@old_spellings("experiment")
@handle_errors
def experiment_cmd(config, out_dir, jobs):
    """Run (or resume) a grid from a TOML config: partition, fit (cached), fuse, evaluate, tables, plots."""
    from posterior_fusion.experiment import ExperimentConfig, run_experiment  # the grid's numerics: when it runs

    if jobs < 1:
        raise ConfigError("--jobs must be >= 1")
    cfg = ExperimentConfig.from_toml(config)
    work = out_dir or f"runs/{cfg.name}"
    run_experiment(cfg, work, jobs, log=log_to_stderr)
    say(open(f"{work}/results.md").read())
    say(f"tables: {work}/results.csv, {work}/results.md; plots: {work}/accuracy_vs_*.png")
