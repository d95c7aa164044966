"""``pfuse demo``: partition, fit-local per silo, fuse with every method, one side-by-side table."""

from __future__ import annotations

import click

from posterior_fusion import ranges
from posterior_fusion.choices import STRUCTURES
from posterior_fusion.cli.common import bounded, echo_json, handle_errors, log_to_stderr, old_spellings, say
from posterior_fusion.demo import DEFAULT_ROW, DEMO_DATASETS, DEMO_METHODS, legend
from posterior_fusion.fusion.registry import QUICK, get_method


@click.command("demo")
@click.option("--out-dir", default="demo-run", show_default=True, type=click.Path(file_okay=False), help="Working folder.")
@click.option("--subset", is_flag=True,
              help="Use the embedded 6,000-image Fashion-MNIST subset even when the full set (Debian's "
                   "dataset-fashion-mnist) is installed [default: the full set when installed].")
@click.option("--full", is_flag=True, hidden=True, help="Deprecated: the full set is the default when installed.")
@click.option("--dataset", default="fmnist", show_default=True, type=click.Choice(DEMO_DATASETS),
              help="fmnist (LeNet) or digits (scikit-learn's real 8x8 digits, an MLP).")
@click.option("--clients", default=5, show_default=True, type=bounded(ranges.CLIENTS), help="Number of clients.")
@click.option("--alpha", default=0.1, show_default=True, type=bounded(ranges.ALPHA, float), help="Dirichlet α.")
@click.option("--components", "-M", default=3, show_default=True, type=bounded(ranges.COMPONENTS), help="Mixture components per client.")
@click.option("--epochs", default=5, show_default=True, type=bounded(ranges.EPOCHS), help="Local epochs.")
@click.option("--structure", default="kron", show_default=True, type=click.Choice(STRUCTURES), help="Curvature structure.")
@click.option("--steps", default=300, show_default=True, type=bounded(ranges.STEPS), help="Server Adam steps (fedbens, fedfisher).")
@click.option("--methods", default=None,
              help=f"Comma-separated fusion methods ('{DEFAULT_ROW}': what fuse runs without --method) [default: "
                   f"{DEFAULT_ROW} and those of {','.join(DEMO_METHODS)} that apply to --structure].")
@click.option("--seed", default=0, show_default=True, type=bounded(ranges.SEED),
              help="Run seed: the partition, init and training seeds of the demo all equal it.")
@click.option("--quick", is_flag=True,
              help="A run of seconds that still learns: the embedded 6,000-image subset, 3 clients at α = 1 (mild "
                   "skew), M = 2, 5 epochs, 100 steps; the default row, fedbens and fedavg (well above chance: about "
                   "70 / 70 / 55 %; the full demo's figures are in docs/choosing.md).")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
@old_spellings("demo")
@handle_errors
def demo_cmd(out_dir, subset, full, dataset, clients, alpha, components, epochs, structure, steps, methods, seed, quick, as_json):
    """Partition -> fit-local per silo -> fuse with every method -> side-by-side test table."""
    from posterior_fusion.demo import run_demo

    chosen = None if methods is None else tuple(m.strip() for m in methods.split(",") if m.strip())
    max_train = None
    if quick:
        clients, alpha, components, epochs, steps, chosen = 3, 1.0, 2, 5, 100, (DEFAULT_ROW, *QUICK)
        subset = True
    for m in chosen or ():
        if m != DEFAULT_ROW:
            get_method(m)
    if full:
        say("warning: --full is deprecated: the full Fashion-MNIST is the default when installed", err=True)
    rows = run_demo(out_dir, subset, clients, alpha, components, epochs, structure, seed, chosen, steps, max_train,
                    log=log_to_stderr, dataset=dataset)
    if as_json:
        echo_json(rows)
        return
    say(f"\n{'method':<14}{'members':>8}{'accuracy':>10}{'NLL':>8}{'ECE':>8}{'Brier':>8}{'fuse s':>8}")
    for r in rows:
        say(f"{r['method']:<14}{r['members']:>8}{r['accuracy']:>10.4f}{r['nll']:>8.3f}{r['ece']:>8.3f}"
                   f"{r['brier']:>8.3f}{r['fuse_seconds']:>8.1f}")
    say("\nOn the test set: accuracy (higher is better); NLL, the mean negative log-likelihood, and ECE,"
               "\nthe expected calibration error (lower is better: honest probabilities); Brier score (lower"
               "\nis better). members = models served per prediction (the serving cost).")
    for r in rows:
        say(f"  {r['method']:<13} {legend(r['method'])}")
    say("Recommended when nothing else is known: the 'default' row (what `pfuse fuse` runs without --method).")
    if quick:
        say("A quick run (6,000 images, 3 clients at α = 1, 5 epochs): `pfuse demo` runs every method on the full data;")
    say("A demo-sized run (few epochs, M small); the full-data tables with spread over seeds are in"
               "\ndocs/choosing.md (which method for which situation) and docs/results/ (every study).")
