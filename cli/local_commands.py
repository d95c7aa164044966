"""``pfuse init`` and ``pfuse fit-local``."""

from __future__ import annotations

import json

import click

from posterior_fusion.artifact import load_global, write_global_artifact
from posterior_fusion.cli.common import echo_json, handle_errors, log_to_stderr, max_memory_option, old_spellings, say
from posterior_fusion.data.silo import read_silo
from posterior_fusion.data.transform import check_transform
from posterior_fusion.errors import ConfigError
from posterior_fusion.files import check_output
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import CAPTURE_METHODS
from posterior_fusion.local.config import GGN_TYPES, STRUCTURES, FitConfig, PrivateModelConfig, TrainConfig
from posterior_fusion.local.fit import fit_to_file
from posterior_fusion.local.init import initial_weights
from posterior_fusion.local.ppd import PPDConfig
from posterior_fusion.models import ModelSpec

FIT, TRAIN, PPD = FitConfig(), TrainConfig(), PPDConfig()


def parse_model(name: str, kwargs_json: str | None, max_memory: int | str | None = None) -> ModelSpec:
    """The model spec, its size checked against the cap and the memory budget before anything is built."""
    try:
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"--model-kwargs is not valid JSON: {getattr(exc, 'msg', exc)}") from None
    spec = ModelSpec(name, kwargs)
    spec.check_size(max_memory)
    return spec


model_option = click.option("--model", default="lenet", show_default=True,
                            help="Model architecture: a built-in (lenet, cnn, mlp, resnet20) or one registered by an "
                                 "installed package under the 'posterior_fusion.models' entry points.")
model_kwargs_option = click.option("--model-kwargs", default=None,
                                   help='JSON keyword arguments of the model, e.g. \'{"bias": true}\' [default: none].')


@click.command("init")
@model_option
@model_kwargs_option
@click.option("--components", "-M", default=5, show_default=True, type=int,
              help="Number of shared starting points M (one per mixture component).")
@click.option("--init-seed", default=0, show_default=True, type=int, help="Seed of the starting points (same as fit-local --init-seed).")
@click.option("--transform-from", default=None, type=click.Path(dir_okay=False),
              help="A data file whose input transform every silo must share (recorded in the init file and "
                   "checked by fit-local) [default: not recorded].")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output init file (HDF5).")
@max_memory_option
@old_spellings("init")
@handle_errors
def init(model, model_kwargs, components, init_seed, transform_from, out, max_memory):
    """Write M shared starting points that every client trains from."""
    check_output(out, inputs=[transform_from])
    spec = parse_model(model, model_kwargs, max_memory)
    if components < 1:
        raise ConfigError("--components must be >= 1")
    meta = {"method": "init", "init_seed": init_seed}
    if transform_from:
        meta["input_transform"] = read_silo(transform_from, labels=False).input_transform.to_dict()
    ws = initial_weights(spec, components, init_seed)
    write_global_artifact(out, spec, ParameterLayout.from_model(spec.build()), meta, ws)
    say(f"wrote {out}: {components} starting points for {spec.name} ({ws[0].numel()} parameters)")


@click.command("fit-local")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False), help="Silo data file (from partition).")
@click.option("--init", "init_path", default=None, type=click.Path(dir_okay=False),
              help="Init file from 'pfuse init' (fixes model and M) [default: derive from --init-seed].")
@click.option("--init-seed", default=0, show_default=True, type=int, help="Seed of the shared starting points when no --init file is given.")
@model_option
@model_kwargs_option
@click.option("--components", "-M", default=5, show_default=True, type=int,
              help="Mixture components M (ignored with --init, which fixes M).")
@click.option("--structure", default=FIT.structure, show_default=True, type=click.Choice(STRUCTURES),
              help="Curvature structure: K-FAC, diagonal, or diagonal + full last layer.")
@click.option("--epochs", default=TRAIN.epochs, show_default=True, type=int, help="Local training epochs per component.")
@click.option("--batch-size", default=TRAIN.batch_size, show_default=True, type=int, help="SGD batch size.")
@click.option("--lr", default=TRAIN.lr, show_default=True, type=float, help="SGD learning rate.")
@click.option("--momentum", default=TRAIN.momentum, show_default=True, type=float, help="SGD momentum.")
@click.option("--weight-decay", default=None, type=float,
              help="SGD weight decay [default: T·λ0/n, which makes the result the tempered-posterior MAP].")
@click.option("--temperature", default=FIT.temperature, show_default=True, type=float, help="Likelihood temperature T recorded for the server.")
@click.option("--prior-var", default=FIT.prior_var, show_default=True, type=float, help="Prior variance σ0² (λ0 = 1/σ0²).")
@click.option("--swag", is_flag=True, help="Also collect SWAG moments over the last epochs.")
@click.option("--swag-rank", default=TRAIN.swag_rank, show_default=True, type=int, help="SWAG deviation columns K.")
@click.option("--ggn", default=FIT.ggn, show_default=True, type=click.Choice(GGN_TYPES),
              help="exact: exact GGN (one backward pass per class); mc: Monte-Carlo Fisher, one sampled label (faster).")
@click.option("--ppd", is_flag=True,
              help="FedPPD: also run an SGLD chain from each component's MAP and distil its posterior predictive "
                   "into a student network stored beside the MAP (fuse --method fedppd / fedppd-distill).")
@click.option("--ppd-steps", default=PPD.steps, show_default=True, type=int, help="SGLD steps of --ppd (burn-in included).")
@click.option("--ppd-burn-in", default=PPD.burn_in, show_default=True, type=int, help="SGLD burn-in steps of --ppd.")
@click.option("--ppd-thin", default=PPD.thin, show_default=True, type=int, help="Keep every this many SGLD iterates.")
@click.option("--ppd-step-size", default=PPD.step_size, show_default=True, type=float, help="SGLD step size ε.")
@click.option("--private-model", default=None,
              help="HBFL's heterogeneous client: this silo's own architecture (a model name), trained first and "
                   "distilled on the silo's data into the shared --model; it never leaves the silo [default: none].")
@click.option("--private-model-kwargs", default="{}", show_default=True, help="JSON keyword arguments of --private-model.")
@click.option("--private-epochs", default=None, type=int, help="Epochs of the private model [default: --epochs].")
@click.option("--private-weight", default=0.5, show_default=True, type=float,
              help="Weight of the distillation term in the shared model's loss (HBFL's 1 − α).")
@click.option("--capture", default=FIT.capture, show_default=True, type=click.Choice(CAPTURE_METHODS),
              help="fast: this package's capture (one forward + one batched backward per batch) for models whose "
                   "parameters all sit in Linear/Conv2d layers, laplace-torch otherwise; laplace: always laplace-torch.")
@click.option("--curvature-batch-size", default=FIT.curvature_batch_size, show_default=True, type=int,
              help="Batch size of the curvature pass.")
@click.option("--train-seed", default=FIT.train_seed, show_default=True, type=int, help="Training seed (data order per component).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output client artifact (HDF5).")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted run from its partial file (.<out>.partial.h5); same settings required.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@max_memory_option
@old_spellings("fit-local")
@handle_errors
def fit_local_cmd(data_path, init_path, init_seed, model, model_kwargs, components, structure, epochs, batch_size, lr,
                  momentum, weight_decay, temperature, prior_var, swag, swag_rank, ggn, ppd, ppd_steps, ppd_burn_in, ppd_thin,
                  ppd_step_size, private_model, private_model_kwargs, private_epochs, private_weight, capture,
                  curvature_batch_size,
                  train_seed, out, resume, as_json, max_memory):
    """Train M models on one silo and write their local posteriors to one artifact."""
    cfg = FitConfig(structure=structure, temperature=temperature, prior_var=prior_var, train_seed=train_seed,
                    curvature_batch_size=curvature_batch_size, ggn=ggn, capture=capture,
                    ppd=PPDConfig(steps=ppd_steps, burn_in=ppd_burn_in, thin=ppd_thin, step_size=ppd_step_size)
                    if ppd else None,
                    private=PrivateModelConfig(private_model, dict(parse_model(private_model, private_model_kwargs).kwargs),
                                               private_epochs, private_weight) if private_model else None,
                    train=TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, momentum=momentum,
                                      weight_decay=weight_decay, swag=swag, swag_rank=swag_rank))
    cfg.validate()
    if init_path is not None:
        init_art = load_global(init_path, max_memory)
        spec, inits = init_art.model_spec, list(init_art.members)
        ctx = click.get_current_context()
        explicit = {name: ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
                    for name in ("model", "model_kwargs", "components")}
        if init_art.method != "init":
            raise ConfigError(f"{init_path}: is a fused global artifact (method {init_art.method!r}), not an init file "
                              "from 'pfuse init'")
        if (explicit["model"] or explicit["model_kwargs"]) and parse_model(model, model_kwargs) != spec:
            raise ConfigError(f"{init_path}: holds starting points for {spec.to_json()}, but --model asks for "
                              f"{parse_model(model, model_kwargs).to_json()}")
        if explicit["components"] and components != len(inits):
            raise ConfigError(f"{init_path}: holds {len(inits)} starting points, but --components asks for {components}")
    else:
        spec = parse_model(model, model_kwargs, max_memory)
        if components < 1:
            raise ConfigError("--components must be >= 1")
        inits = initial_weights(spec, components, init_seed)
    data = read_silo(data_path, num_classes=spec.num_classes, max_memory=max_memory)
    if init_path is not None:
        check_transform(init_art.metadata.get("input_transform"), data.input_transform, data_path, init_path)
    init_info = {"file": init_path} if init_path else {"init_seed": init_seed}
    meta, comps = fit_to_file(spec, data, inits, cfg, out, init_info, resume=resume, log=log_to_stderr)
    if as_json:
        echo_json({"out": out, "n_data": meta["n_data"], "components": [dict(c.training) for c in comps]})
    else:
        say(f"wrote {out}: {len(comps)} components, structure {structure}, n={meta['n_data']}")


@click.command("recapture")
@click.option("--from", "source_path", required=True, type=click.Path(dir_okay=False),
              help="Client artifact (from fit-local) whose trained components are reused.")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="The silo the artifact was fitted on (its SHA-256 is checked against the artifact's).")
@click.option("--structure", required=True, type=click.Choice(STRUCTURES),
              help="Curvature structure to capture at every component MAP.")
@click.option("--ggn", default=None, type=click.Choice(GGN_TYPES),
              help="exact or mc GGN [default: the source artifact's].")
@click.option("--capture", default=FIT.capture, show_default=True, type=click.Choice(CAPTURE_METHODS),
              help="fast (this package's capture where the model allows) or laplace (laplace-torch).")
@click.option("--curvature-batch-size", default=None, type=int, help="Batch size of the curvature pass [default: the source's].")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output client artifact (HDF5).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@max_memory_option
@handle_errors
def recapture_cmd(source_path, data_path, structure, ggn, capture, curvature_batch_size, out, as_json, max_memory):
    """Capture another curvature structure for an artifact's trained components, without retraining.

    Training does not depend on the structure, so this writes what fit-local with the same seeds
    and --structure would have written, for the cost of the capture alone.
    """
    from posterior_fusion.local.recapture import recapture_to_file

    meta = recapture_to_file(source_path, data_path, out, structure, ggn, curvature_batch_size, capture,
                             max_memory, log=log_to_stderr)
    if as_json:
        echo_json({"out": out, "structure": structure, "n_data": meta["n_data"], "recaptured_from": meta["recaptured_from"]})
    else:
        say(f"wrote {out}: structure {structure}, n={meta['n_data']} (recaptured from {source_path})")
