"""``pfuse inspect``."""

from __future__ import annotations

import click

from posterior_fusion.artifact import load
from posterior_fusion.cli.common import echo_json, handle_errors, max_memory_option
from posterior_fusion.inspect import summarize


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@click.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the full summary as JSON.")
@max_memory_option
@handle_errors
def inspect_cmd(file, as_json, max_memory):
    """Validate an artifact and summarise it (model, layout, structure, sizes, metadata)."""
    s = summarize(load(file, max_memory))
    if as_json:
        echo_json(s)
        return
    click.echo(f"{s['file']}  ({s['kind']} artifact, {_bytes(s['file_bytes'])}, sha256 {s['sha256'][:16]}…)")
    click.echo(f"model: {s['model']['name']} {s['model']['kwargs']}  parameters d={s['num_params']}")
    click.echo("layout:")
    for e in s["layout"]:
        click.echo(f"  {e['name']:<14} {str(tuple(e['shape'])):<18} offset {e['offset']}")
    meta = s["metadata"]
    if s["metadata"].get("partial"):
        click.echo("PARTIAL: an interrupted fit-local run (finish it with --resume); fuse refuses it")
    if s["kind"] == "client":
        click.echo(f"structure: {s['structure']}  n_data={meta['n_data']}  T={meta['temperature']}  "
                   f"λ0={meta['prior_precision']}  class counts {meta['class_counts']}")
        click.echo("components:")
        for c in s["components"]:
            t = c["training"]
            click.echo(f"  [{c['index']}] blocks {c['blocks']}  curvature {_bytes(c['curvature_bytes'])} "
                       f"({c['curvature_bytes_per_param']}x params)  swag K={c['swag_rank']}  "
                       f"loss {t.get('final_loss', float('nan')):.4f} acc {t.get('final_accuracy', float('nan')):.3f}")
    else:
        click.echo(f"method: {s['method']}  members: {s['num_members']}")
        for key in sorted(meta):
            if key not in ("history",):
                click.echo(f"  {key}: {meta[key]}")
