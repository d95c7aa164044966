"""``pfuse fuse``, ``pfuse evaluate``, ``pfuse predict``, ``pfuse demo``."""

from __future__ import annotations

import click
import h5py
import numpy as np

from posterior_fusion.artifact import load_global, write_global_artifact
from posterior_fusion.artifact.atomic import atomic_h5_write
from posterior_fusion.cli.common import echo_json, handle_errors, log_to_stderr
from posterior_fusion.data.silo import read_silo
from posterior_fusion.demo import DEMO_METHODS, run_demo
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.common import FusionOptions
from posterior_fusion.fusion.registry import METHODS, fuse
from posterior_fusion.fusion.resources import parse_bytes
from posterior_fusion.fusion.tuning import parse_tune
from posterior_fusion.metrics import ensemble_probabilities, evaluate_members, reliability_plot


def parse_floats(text: str, option: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"{option} must be a comma list of numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ConfigError(f"{option} needs positive numbers, got {text!r}")
    return values


@click.command("fuse")
@click.argument("clients", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--method", default="fedbens", show_default=True, type=click.Choice(list(METHODS)), help="Fusion method.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output global artifact (HDF5).")
@click.option("--val", "val_path", default=None, type=click.Path(dir_okay=False),
              help="Server validation data; selects the best iterate per mode [default: best objective].")
@click.option("--unlabeled", default=None, type=click.Path(dir_okay=False), help="Unlabeled server data (fedbe distillation).")
@click.option("--steps", default=300, show_default=True, type=int, help="Adam steps per mode (fedbens, fedfisher).")
@click.option("--lr", default=1e-3, show_default=True, type=float, help="Adam learning rate.")
@click.option("--clip", default=1.0, show_default=True, type=float, help="Gradient-norm clip per mode.")
@click.option("--val-every", default=30, show_default=True, type=int, help="Validate every this many steps (and at the last).")
@click.option("--temperature", default=None, type=float, help="Re-temper every client with this T [default: each client's T].")
@click.option("--prior-var", default=None, type=float, help="Prior variance σ0² for every client and the global prior [default: clients'].")
@click.option("--modes", default=None, type=int, help="Number of global modes [default: the clients' M].")
@click.option("--mode-index", default=0, show_default=True, type=int, help="Client component used by unimodal baselines.")
@click.option("--num-samples", default=10, show_default=True, type=int, help="Samples for fedbe / swag.")
@click.option("--regmean-alpha", default=1.0, show_default=True, type=float, help="RegMean scaling of off-diagonal Gram entries.")
@click.option("--distill-epochs", default=5, show_default=True, type=int, help="fedbe distillation epochs (with --unlabeled).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for sampling methods.")
@click.option("--lowrank-tol", default=0.0, show_default=True, type=float,
              help="Kronecker low-rank shortcut: drop eigen-directions with curvature < tol·λ0 (relative objective error < tol); 0 = exact.")
@click.option("--kernel", default=None, type=click.Choice(["torch", "triton"]),
              help="Kronecker kernel backend [default: triton on CUDA when installed, else torch].")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="Device for fedbens/fedfisher optimisation.")
@click.option("--tune", default=None,
              help="Choose T and/or prior variance on --val over a grid: 'T', 'prior' or 'T,prior' [default: no tuning].")
@click.option("--tune-temperatures", default="0.01,0.03,0.1,0.3,1.0", show_default=True, help="Grid of T for --tune.")
@click.option("--tune-prior-vars", default="0.01,0.1,1.0", show_default=True, help="Grid of σ0² for --tune.")
@click.option("--robust", is_flag=True,
              help="Screen out clients whose curvature scale (>100x) or MAP distance (>3x) is far from the others' median.")
@click.option("--max-memory", default=None,
              help="Refuse work estimated above this size, e.g. 8G [default: 80% of available memory, or $PFUSE_MAX_MEMORY].")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@handle_errors
def fuse_cmd(clients, method, out, val_path, unlabeled, steps, lr, clip, val_every, temperature, prior_var, modes,
             mode_index, num_samples, regmean_alpha, distill_epochs, seed, lowrank_tol, kernel, device, tune, tune_temperatures, tune_prior_vars, robust,
             max_memory, as_json):
    """Validate client artifacts and fuse them into a global ensemble."""
    opts = FusionOptions(steps=steps, lr=lr, clip=clip, val_every=val_every, temperature=temperature,
                         prior_var=prior_var, modes=modes, seed=seed, mode_index=mode_index, num_samples=num_samples,
                         regmean_alpha=regmean_alpha, distill_epochs=distill_epochs,
                         lowrank_tol=lowrank_tol, kernel=kernel, device=device)
    limit = parse_bytes(max_memory) if max_memory is not None else None
    inputs, result, meta = fuse(list(clients), method, opts, val_path, unlabeled, log=log_to_stderr,
                                robust=robust, max_memory=limit, tune=parse_tune(tune),
                                tune_temperatures=parse_floats(tune_temperatures, "--tune-temperatures"),
                                tune_prior_vars=parse_floats(tune_prior_vars, "--tune-prior-vars"))
    if "tuning" in meta:
        chosen = meta["tuning"]["chosen"]
        click.echo(f"tuned: T={chosen['temperature']} prior_var={chosen['prior_var']} "
                   f"(val accuracy {chosen['val_accuracy']:.4f})")
    write_global_artifact(out, inputs.spec, inputs.clients[0].layout, meta, result.members)
    if as_json:
        echo_json({"out": out, "method": method, "members": len(result.members), "fuse_seconds": meta["fuse_seconds"]})
        return
    click.echo(f"wrote {out}: {method}, {len(result.members)} members, {meta['fuse_seconds']:.1f}s")
    for k, hist in enumerate(meta.get("history", [])):
        best = max(hist, key=lambda h: h.get("val_accuracy", -h["objective"]))
        extra = f" val acc {best['val_accuracy']:.4f}" if "val_accuracy" in best else ""
        click.echo(f"  mode {k}: best step {best['step']} objective {best['objective']:.6g}{extra}")


@click.command("evaluate")
@click.argument("global_artifact", type=click.Path(dir_okay=False))
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False), help="Labelled data file (e.g. test.h5).")
@click.option("--bins", default=15, show_default=True, type=int, help="ECE bins.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False), help="Write a reliability diagram PNG here.")
@click.option("--json", "as_json", is_flag=True, help="Print metrics as JSON.")
@handle_errors
def evaluate_cmd(global_artifact, data_path, bins, plot, as_json):
    """Accuracy, NLL, ECE, Brier and member accuracy range of a fused ensemble."""
    g = load_global(global_artifact)
    data = read_silo(data_path, num_classes=g.model_spec.num_classes)
    m = evaluate_members(g.model_spec, list(g.members), data, bins)
    if plot:
        reliability_plot(m["reliability"], plot, title=f"{g.method} (ECE {m['ece']:.3f})")
    if as_json:
        echo_json({"method": g.method, **m})
        return
    click.echo(f"{g.method}: accuracy {m['accuracy']:.4f}  NLL {m['nll']:.4f}  ECE {m['ece']:.4f}  "
               f"Brier {m['brier']:.4f}  members {m['num_members']} "
               f"(single-member accuracy {m['member_accuracy_min']:.4f}..{m['member_accuracy_max']:.4f})  n={m['n']}")


@click.command("predict")
@click.argument("global_artifact", type=click.Path(dir_okay=False))
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False), help="Data file with /x.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output HDF5 with /probs (n, classes).")
@handle_errors
def predict_cmd(global_artifact, data_path, out):
    """Write the ensemble's averaged class probabilities."""
    g = load_global(global_artifact)
    data = read_silo(data_path, num_classes=g.model_spec.num_classes)
    probs, _ = ensemble_probabilities(g.model_spec, list(g.members), data.tensors()[0])

    def fill(f: h5py.File) -> None:
        f.attrs["format"] = "posterior-fusion-predictions"
        f.attrs["global_sha256"] = g.sha256
        f.create_dataset("probs", data=probs.numpy().astype(np.float32))

    atomic_h5_write(out, fill)
    click.echo(f"wrote {out}: probabilities {tuple(probs.shape)}")


@click.command("demo")
@click.option("--out-dir", default="demo-run", show_default=True, type=click.Path(file_okay=False), help="Working folder.")
@click.option("--full", is_flag=True, help="Use the full Fashion-MNIST (Debian package) instead of the embedded subset.")
@click.option("--clients", default=5, show_default=True, type=int, help="Number of clients.")
@click.option("--alpha", default=0.1, show_default=True, type=float, help="Dirichlet α.")
@click.option("--mixtures", "-M", default=3, show_default=True, type=int, help="Components per client.")
@click.option("--epochs", default=5, show_default=True, type=int, help="Local epochs.")
@click.option("--hessian", "structure", default="kron", show_default=True, type=click.Choice(["kron", "diag", "diag+full"]),
              help="Curvature structure.")
@click.option("--steps", default=300, show_default=True, type=int, help="Server Adam steps.")
@click.option("--methods", default=",".join(DEMO_METHODS), show_default=True, help="Comma-separated fusion methods.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for partition, init and training.")
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
@handle_errors
def demo_cmd(out_dir, full, clients, alpha, mixtures, epochs, structure, steps, methods, seed, as_json):
    """Partition -> fit-local per silo -> fuse with every method -> side-by-side test table."""
    chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
    rows = run_demo(out_dir, full, clients, alpha, mixtures, epochs, structure, seed, chosen, steps, log=log_to_stderr)
    if as_json:
        echo_json(rows)
        return
    click.echo(f"\n{'method':<14}{'members':>8}{'accuracy':>10}{'NLL':>8}{'ECE':>8}{'Brier':>8}{'fuse s':>8}")
    for r in rows:
        click.echo(f"{r['method']:<14}{r['members']:>8}{r['accuracy']:>10.4f}{r['nll']:>8.3f}{r['ece']:>8.3f}"
                   f"{r['brier']:>8.3f}{r['fuse_seconds']:>8.1f}")
