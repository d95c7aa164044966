"""``pfuse init`` and ``pfuse fit-local``."""

from __future__ import annotations

import json
from pathlib import Path

import click

from posterior_fusion.artifact import load_client, load_global, write_client_artifact, write_global_artifact
from posterior_fusion.cli.common import echo_json, handle_errors, log_to_stderr
from posterior_fusion.data.silo import read_silo
from posterior_fusion.errors import ConfigError
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.fit import FitConfig, fit_local, fit_metadata
from posterior_fusion.local.init import initial_weights
from posterior_fusion.local.train import TrainConfig
from posterior_fusion.models import MODEL_REGISTRY, ModelSpec


def parse_model(name: str, kwargs_json: str | None) -> ModelSpec:
    try:
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model-kwargs is not valid JSON: {exc.msg}") from None
    return ModelSpec(name, kwargs)


model_option = click.option("--model", default="lenet", show_default=True, type=click.Choice(sorted(MODEL_REGISTRY)),
                            help="Registered model architecture.")
model_kwargs_option = click.option("--model-kwargs", default=None,
                                   help='JSON keyword arguments of the model, e.g. \'{"bias": true}\' [default: none].')


@click.command("init")
@model_option
@model_kwargs_option
@click.option("--mixtures", "-M", default=5, show_default=True, type=int, help="Number of shared starting points M.")
@click.option("--seed", default=0, show_default=True, type=int, help="Initialisation seed (same as fit-local --init-seed).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output init file (HDF5).")
@handle_errors
def init(model, model_kwargs, mixtures, seed, out):
    """Write M shared starting points that every client trains from."""
    spec = parse_model(model, model_kwargs)
    if mixtures < 1:
        raise ConfigError("--mixtures must be >= 1")
    ws = initial_weights(spec, mixtures, seed)
    write_global_artifact(out, spec, ParameterLayout.from_model(spec.build()),
                          {"method": "init", "init_seed": seed}, ws)
    click.echo(f"wrote {out}: {mixtures} starting points for {spec.name} ({ws[0].numel()} parameters)")


def partial_path(out: str) -> Path:
    p = Path(out)
    return p.with_name(f".{p.name}.partial.h5")


def resume_state(out: str, spec: ModelSpec, data, inits, cfg: FitConfig, resume: bool) -> tuple[list, Path]:
    """Components finished by an interrupted run (if ``--resume``) and the partial file's path."""
    partial = partial_path(out)
    if not partial.exists():
        if resume:
            log_to_stderr(f"note: no partial run at {partial}; starting from the first component")
        return [], partial
    if not resume:
        log_to_stderr(f"note: discarding the partial run at {partial} (pass --resume to continue it)")
        return [], partial
    previous = load_client(partial)
    expected = fit_metadata(spec, data, inits, cfg)["fit_fingerprint"]
    if previous.metadata.get("fit_fingerprint") != expected:
        raise ConfigError(f"{partial}: the partial run used different settings, data or inits; "
                          "rerun with the same options or delete it")
    log_to_stderr(f"resuming: {previous.num_components} of {len(inits)} components already done")
    return list(previous.components), partial


@click.command("fit-local")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False), help="Silo data file (from partition).")
@click.option("--init", "init_path", default=None, type=click.Path(dir_okay=False),
              help="Init file from 'pfuse init' (fixes model and M) [default: derive from --init-seed].")
@click.option("--init-seed", default=0, show_default=True, type=int, help="Seed of the shared starting points when no --init file is given.")
@model_option
@model_kwargs_option
@click.option("--mixtures", "-M", default=5, show_default=True, type=int, help="Components M (ignored with --init, which fixes M).")
@click.option("--hessian", "structure", default="kron", show_default=True, type=click.Choice(["kron", "diag", "diag+full"]),
              help="Curvature structure: K-FAC, diagonal, or diagonal + full last layer.")
@click.option("--epochs", default=20, show_default=True, type=int, help="Local training epochs per component.")
@click.option("--batch-size", default=64, show_default=True, type=int, help="SGD batch size.")
@click.option("--lr", default=0.01, show_default=True, type=float, help="SGD learning rate.")
@click.option("--momentum", default=0.9, show_default=True, type=float, help="SGD momentum.")
@click.option("--weight-decay", default=-1.0, show_default=True, type=float,
              help="SGD weight decay; negative = T·λ0/n, which makes the result the tempered-posterior MAP.")
@click.option("--temperature", default=0.1, show_default=True, type=float, help="Likelihood temperature T recorded for the server.")
@click.option("--prior-var", default=0.1, show_default=True, type=float, help="Prior variance σ0² (λ0 = 1/σ0²).")
@click.option("--swag", is_flag=True, help="Also collect SWAG moments over the last epochs.")
@click.option("--swag-rank", default=20, show_default=True, type=int, help="SWAG deviation columns K.")
@click.option("--ggn", default="exact", show_default=True, type=click.Choice(["exact", "mc"]),
              help="exact: exact GGN (one backward pass per class); mc: Monte-Carlo Fisher, one sampled label (faster).")
@click.option("--curvature-batch-size", default=256, show_default=True, type=int, help="Batch size of the curvature pass.")
@click.option("--seed", default=0, show_default=True, type=int, help="Training seed (data order).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output client artifact (HDF5).")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted run from its partial file (.<out>.partial.h5); same settings required.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@handle_errors
def fit_local_cmd(data_path, init_path, init_seed, model, model_kwargs, mixtures, structure, epochs, batch_size, lr,
                  momentum, weight_decay, temperature, prior_var, swag, swag_rank, ggn, curvature_batch_size, seed, out, resume, as_json):
    """Train M models on one silo and write their local posteriors to one artifact."""
    if init_path is not None:
        init_art = load_global(init_path)
        spec, inits = init_art.model_spec, list(init_art.members)
    else:
        spec = parse_model(model, model_kwargs)
        if mixtures < 1:
            raise ConfigError("--mixtures must be >= 1")
        inits = initial_weights(spec, mixtures, init_seed)
    if epochs < 0 or batch_size < 1 or lr <= 0 or swag_rank < 1:
        raise ConfigError("--epochs must be >= 0, --batch-size and --swag-rank >= 1, --lr > 0")
    data = read_silo(data_path, num_classes=spec.num_classes)
    cfg = FitConfig(structure=structure, temperature=temperature, prior_var=prior_var, seed=seed,
                    curvature_batch_size=curvature_batch_size, ggn=ggn,
                    train=TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, momentum=momentum,
                                      weight_decay=weight_decay, swag=swag, swag_rank=swag_rank))
    layout = ParameterLayout.from_model(spec.build())
    init_info = {"file": init_path} if init_path else {"init_seed": init_seed}
    done, partial = resume_state(out, spec, data, inits, cfg, resume)

    def save_partial(meta: dict, comps: list) -> None:
        write_client_artifact(partial, spec, layout, dict(meta, init=init_info, partial=True), comps)

    meta, comps = fit_local(spec, data, inits, cfg, log=log_to_stderr, done=done, on_component=save_partial)
    meta["init"] = init_info
    write_client_artifact(out, spec, layout, meta, comps)
    partial.unlink(missing_ok=True)
    if as_json:
        echo_json({"out": out, "n_data": meta["n_data"], "components": [dict(c.training) for c in comps]})
    else:
        click.echo(f"wrote {out}: {len(comps)} components, structure {structure}, n={meta['n_data']}")
