"""``pfuse partition``."""

from __future__ import annotations

import click

from posterior_fusion.cli.common import echo_json, handle_errors, renamed
from posterior_fusion.data.prepare import DATASETS, partition_to_files


@click.command("partition")
@click.option("--dataset", default="fmnist", show_default=True, type=click.Choice(DATASETS), help="Data set to split.")
@click.option("--clients", default=5, show_default=True, type=int, help="Number of client silos C.")
@click.option("--alpha", default=0.1, show_default=True, type=float, help="Dirichlet concentration α (smaller = more non-IID).")
@click.option("--partition-seed", default=0, show_default=True, type=int,
              help="Seed of the split (separate from init and training seeds).")
@click.option("--out-dir", required=True, type=click.Path(file_okay=False), help="Folder for client_<i>.h5, server_val.h5, test.h5.")
@click.option("--val-size", default=500, show_default=True, type=int, help="Server validation samples, disjoint from all clients.")
@click.option("--min-size", default=10, show_default=True, type=int, help="Redraw until every client has at least this many samples.")
@click.option("--scheme", default="fedbens", show_default=True, type=click.Choice(["fedbens", "per-class"]),
              help="fedbens: client-wise Dir(α·1_K) class proportions; per-class: Dir(α·1_C) over clients per class.")
@click.option("--data-dir", default=None, type=click.Path(file_okay=False),
              help="Folder with the Fashion-MNIST IDX .gz files [default: /usr/share/datasets/fashion-mnist, else the embedded subset].")
@click.option("--max-train", default=None, type=int, help="Use at most this many training samples [default: all].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@renamed("--seed", "--partition-seed", "partition_seed", type=int)
@handle_errors
def partition(dataset, clients, alpha, partition_seed, out_dir, val_size, min_size, scheme, data_dir, max_train, as_json):
    """Split a data set into non-IID client silos plus server validation and test files."""
    summary = partition_to_files(out_dir, dataset, clients, alpha, partition_seed, val_size, min_size, scheme,
                                 data_dir, max_train)
    if as_json:
        echo_json(summary)
        return
    click.echo(f"source: {summary['source']}  alpha={alpha} partition_seed={partition_seed} scheme={scheme}")
    for i, c in enumerate(summary["clients"]):
        click.echo(f"client_{i}: n={c['n']:6d}  class counts {c['class_counts']}")
    click.echo(f"server_val: {summary['server_val']}\ntest: {summary['test']}")
