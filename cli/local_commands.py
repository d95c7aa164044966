"""``pfuse init``, ``fit-local``, ``recapture``, ``refresh`` and ``audit``. The options come from torch-free
declarations (:mod:`posterior_fusion.choices`, :mod:`posterior_fusion.local.fit_config`); the code that
trains and captures is imported when a command runs, so ``--help`` starts without torch."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import click

from posterior_fusion import ranges
from posterior_fusion.cli.common import (
    bounded,
    declared_option,
    echo_json,
    handle_errors,
    log_to_stderr,
    max_memory_option,
    old_spellings,
    say,
    setting_options,
)
from posterior_fusion.data.silo import read_silo, silo_header
from posterior_fusion.errors import ConfigError
from posterior_fusion.files import check_output
from posterior_fusion.local.fit_config import FitConfig, fit_config_from, fit_settings
from posterior_fusion.local.recapture_settings import CaptureChoice
from posterior_fusion.local.refresh_settings import (
    RefreshPrivacy,
    RefreshStep,
    refresh_privacy_from,
)
from posterior_fusion.local.start_settings import StartSettings
from posterior_fusion.runtime import resolve_device
from posterior_fusion.settings import declared_default, declared_help, record_from

if typing.TYPE_CHECKING:
    from posterior_fusion.models import ModelSpec

FIT = FitConfig()


def parse_model(name: str, kwargs_json: str | None, max_memory: int | str | None = None,
                fit_to: tuple | None = None) -> ModelSpec:
    """The model spec (with ``fit_to=(input_shape, num_classes, file)``: what it leaves out taken
    from the data), its size checked against the cap and the memory budget before anything is built."""
    try:
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"--model-kwargs is not valid JSON: {getattr(exc, 'msg', exc)}") from None
    from posterior_fusion.models import ModelSpec

    spec = ModelSpec(name, kwargs)
    spec.check_size(max_memory)  # the spec as given first: a bomb is refused before anything else
    if fit_to is not None:
        spec = spec.fitted_to(*fit_to)
        spec.check_size(max_memory)
    return spec


model_option = click.option("--model", default=declared_default(StartSettings, "model"), show_default=True,
                            help=declared_help(StartSettings, "model"))
model_kwargs_option = click.option("--model-kwargs", default=None,
                                   help='JSON keyword arguments of the model, e.g. \'{"bias": true}\' [default: none].')


@click.command("init")
@model_option
@model_kwargs_option
@click.option("--components", "-M", default=declared_default(StartSettings, "components"), show_default=True,
              type=bounded(ranges.COMPONENTS), help=declared_help(StartSettings, "components"))
@click.option("--init-seed", default=declared_default(StartSettings, "init_seed"), show_default=True,
              type=bounded(ranges.SEED), help=declared_help(StartSettings, "init_seed") + " (as fit-local's)")
@click.option("--transform-from", default=None, type=click.Path(dir_okay=False),
              help="A data file whose input transform every silo must share (recorded in the init file and "
                   "checked by fit-local) [default: not recorded].")
@click.option("--base", "base_path", default=None, type=click.Path(dir_okay=False),
              help="Pretrained weights every starting point takes (fine-tuning a shared base): a .safetensors file "
                   "with exactly the model's parameters by name, or a global artifact of the same model (its first "
                   "member). Its SHA-256 is recorded here, in every client artifact and in the fused global; fuse "
                   "refuses clients with different bases [default: random starting points from --init-seed].")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output init file (HDF5).")
@max_memory_option
@old_spellings("init")
@handle_errors
def init(model, model_kwargs, components, init_seed, transform_from, base_path, out, max_memory):
    """Write M shared starting points that every client trains from."""
    from posterior_fusion.artifact import write_global_artifact
    from posterior_fusion.layout import ParameterLayout
    from posterior_fusion.local.init import initial_weights, read_base

    check_output(out, inputs=[transform_from, base_path])
    spec = parse_model(model, model_kwargs, max_memory)
    if components < 1:
        raise ConfigError("--components must be >= 1")
    meta = {"method": "init", "init_seed": init_seed}
    if transform_from:
        meta["input_transform"] = read_silo(transform_from, labels=False).input_transform.to_dict()
    if base_path is not None:
        spec, w, sha = read_base(spec, base_path, max_memory)  # with a BatchNorm model's statistics, frozen
        ws = [w.clone() for _ in range(components)]
        meta["base"] = {"sha256": sha, "file": Path(base_path).name}
    else:
        ws = initial_weights(spec, components, init_seed)
    write_global_artifact(out, spec, ParameterLayout.from_model(spec.build()), meta, ws)
    source = f" from the base {base_path}" if base_path else ""
    say(f"wrote {out}: {components} starting points for {spec.name}{source} ({ws[0].numel()} parameters)")


def fit_options(fn, only: tuple[str, ...] | None = None):
    """One option per fit setting (:func:`~posterior_fusion.local.fit_config.fit_settings`: the settings of the
    nested fit records, flattened, each declared once), built as every setting's option is
    (:func:`~posterior_fusion.cli.common.declared_option`); ``only``: those settings."""
    from posterior_fusion.settings import base_type

    for s in reversed([s for s in fit_settings() if only is None or s.name in only]):
        fn = declared_option(fn, s.name, base_type(s.type), s.default, s.help, choices=s.choices,
                             choice_docs=s.choice_docs)
    return fn


@click.command("fit-local")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False), help="Silo data file (from partition).")
@click.option("--init", "init_path", default=None, type=click.Path(dir_okay=False),
              help="Init file from 'pfuse init' (fixes model and M; from 'init --base BASE' every component "
                   "fine-tunes the base and the prior N(base, σ0² I) is centred at it) [default: derive from "
                   "--init-seed, the prior centred at zero].")
@click.option("--init-seed", default=declared_default(StartSettings, "init_seed"), show_default=True,
              type=bounded(ranges.SEED), help=declared_help(StartSettings, "init_seed").rstrip(".") + ", when no --init file is given.")
@model_option
@model_kwargs_option
@click.option("--components", "-M", default=declared_default(StartSettings, "components"), show_default=True,
              type=bounded(ranges.COMPONENTS), help=declared_help(StartSettings, "components") + " Ignored with --init, "
              "which fixes M.")
@fit_options
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output client artifact (HDF5).")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted run from its partial file (.<out>.partial.h5); same settings required.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@max_memory_option
@old_spellings("fit-local")
@handle_errors
def fit_local_cmd(data_path, init_path, init_seed, model, model_kwargs, components, out, resume, as_json, max_memory,
                  **settings):
    """Train M models on one silo and write their local posteriors to one artifact."""
    from posterior_fusion.local.fit import Start, fit_local

    ctx = click.get_current_context()
    given = [name for name in settings if name.startswith("dp_")
             and ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given and not settings.get("dp"):
        raise ConfigError(f"--{given[0].replace('_', '-')} is set but differential privacy is off: add --dp to fit "
                          "privately, or leave the privacy options out (an ordinary fit protects nothing)")
    cfg = fit_config_from(settings)
    resolve_device(cfg.device, "--device")  # before the data is read
    explicit = {name: ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
                for name in ("model", "model_kwargs", "components")}
    if init_path is not None:
        spec = parse_model(model, model_kwargs) if explicit["model"] or explicit["model_kwargs"] else None
        start = Start(init_file=init_path, components=components if explicit["components"] else None)
    else:
        head = silo_header(data_path)  # the model takes its input size and class count from the data
        spec = parse_model(model, model_kwargs, max_memory, fit_to=(head.input_shape, head.num_classes, data_path))
        if components < 1:
            raise ConfigError("--components must be >= 1")
        if cfg.finetune != "all":
            raise ConfigError(f"--finetune {cfg.finetune} fine-tunes part of a pretrained base: give --init a file from "
                              "`pfuse init --base BASE`")
        start = Start(init_seed=init_seed, components=components)
    meta, comps = fit_local(spec, data_path, start, cfg, out, log=log_to_stderr, resume=resume, max_memory=max_memory)
    if as_json:
        echo_json({"out": out, "n_data": meta["n_data"], "components": [dict(c.training) for c in comps]})
    else:
        say(f"wrote {out}: {len(comps)} components, structure {cfg.structure}, n={meta['n_data']}")


def refresh_options(fn):
    """The options of a refresh round (``pfuse refresh``): its step and its privacy."""
    fn = setting_options(RefreshPrivacy, text=True, metavar="NUMBER")(fn)
    return setting_options(RefreshStep)(fn)


def capture_options(fn):
    """The capture options recapture and refresh share, and their output."""
    fn = click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")(fn)
    fn = click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output client artifact (HDF5).")(fn)
    return setting_options(CaptureChoice)(fn)


def refresh_settings(damping, trust_radius, refresh_dp_epsilon, refresh_dp_delta, refresh_dp_clip):
    """(damping, trust radius, privacy) of a refresh round from the CLI's values."""
    step = record_from(RefreshStep, {"damping": damping, "trust_radius": trust_radius})
    given = {k: v for k, v in (("refresh_dp_epsilon", refresh_dp_epsilon), ("refresh_dp_delta", refresh_dp_delta),
                               ("refresh_dp_clip", refresh_dp_clip)) if v is not None}
    return step.damping_value, step.trust_radius, refresh_privacy_from(given)


@click.command("recapture")
@click.option("--artifact", "source_path", required=True, type=click.Path(dir_okay=False),
              help="Client artifact (from fit-local) whose trained components are reused.")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="The silo the artifact was fitted on (its SHA-256 is checked against the artifact's).")
@capture_options
@click.option("--merge", is_flag=True,
              help="For an artifact that fine-tuned part of a base (fit-local --finetune head, last:K, lora:R): write "
                   "one of the whole architecture instead — each component's weights with the frozen ones put back "
                   "and LoRA merged (W + B A), the curvature captured over every weight there, a BatchNorm model's "
                   "statistics still the base's — so fuse combines the "
                   "products ΔW with their own curvature, not the adapter factors [default: off].")
@lambda fn: fit_options(fn, only=("capture_dtype", "device", "compress", "compress_metric", "compress_vectors"))
@max_memory_option
@handle_errors
def recapture_cmd(source_path, data_path, structure, ggn, capture, curvature_batch_size, out, as_json, kfac,
                  merge, capture_dtype, device, compress, compress_metric, compress_vectors, max_memory):
    """Capture another curvature structure for an artifact's trained components, without retraining.

    Training does not depend on the structure, so this writes what fit-local with the same seeds
    and --structure would have written, for the cost of the capture alone. A refresh round (the
    curvature at a fused global's members) is `pfuse refresh`.
    """
    from posterior_fusion.curvature.compressed import Compression
    from posterior_fusion.local.recapture import recapture_to_file

    meta = recapture_to_file(source_path, data_path, out, structure, ggn, curvature_batch_size, capture,
                             max_memory, log=log_to_stderr, kfac=kfac, capture_dtype=capture_dtype, device=device,
                             compression=Compression(compress, compress_metric, compress_vectors), merge=merge)
    if as_json:
        echo_json({"out": out, "structure": meta["structure"], "n_data": meta["n_data"],
                   "recaptured_from": meta["recaptured_from"]})
    else:
        say(f"wrote {out}: structure {meta['structure']}, n={meta['n_data']} (recaptured from {source_path})")


@click.command("refresh")
@click.option("--artifact", "source_path", required=True, type=click.Path(dir_okay=False),
              help="This silo's own client artifact (from fit-local): model, structure, T and λ0 are its.")
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="The silo the artifact was fitted on (its SHA-256 is checked against the artifact's).")
@click.option("--at", "at_path", required=True, type=click.Path(dir_okay=False),
              help="A fused global artifact (from fuse) of the same model; the curvature is taken at each of its "
                   "members instead of the local MAPs, each component becoming the Gauss-Newton Gaussian of the "
                   "silo's posterior there (one gradient pass and one capture per member, no training).")
@capture_options
@refresh_options
@lambda fn: fit_options(fn, only=("capture_dtype", "device", "compress", "compress_metric", "compress_vectors"))
@max_memory_option
@handle_errors
def refresh_cmd(source_path, data_path, at_path, structure, ggn, capture, curvature_batch_size, out, as_json, kfac,
                damping, trust_radius, refresh_dp_epsilon, refresh_dp_delta, refresh_dp_clip, capture_dtype, device,
                compress, compress_metric, compress_vectors, max_memory):
    """The silo's half of a refresh round: its own artifact re-expanded at a fused global's members.

    Private by default (refresh-dp-epsilon): the gradient at each member is released through the
    Gaussian mechanism and the curvature is the artifact's own. Fuse the refreshed artifacts again.
    """
    from posterior_fusion.curvature.compressed import Compression
    from posterior_fusion.local.refresh import refresh_to_file

    damping, trust_radius, privacy = refresh_settings(damping, trust_radius, refresh_dp_epsilon, refresh_dp_delta,
                                                      refresh_dp_clip)
    meta = refresh_to_file(source_path, data_path, at_path, out, structure, ggn, curvature_batch_size, capture,
                           max_memory, log=log_to_stderr, kfac=kfac, device=device,
                           compression=Compression(compress, compress_metric, compress_vectors), damping=damping,
                           capture_dtype=capture_dtype, trust_radius=trust_radius, privacy=privacy)
    if as_json:
        echo_json({"out": out, "structure": meta["structure"], "n_data": meta["n_data"],
                   "recaptured_from": meta["recaptured_from"], "refreshed_at": meta.get("refreshed_at")})
    else:
        say(f"wrote {out}: structure {meta['structure']}, n={meta['n_data']} (refreshed at the "
            f"{meta['refreshed_at']['members']} members of {at_path})")


@click.command("audit")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False),
              help="The silo FILE was fitted on (its SHA-256 is checked against the artifact's).")
@click.option("--holdout", "holdout_path", default=None, type=click.Path(dir_okay=False),
              help="Labelled samples the silo never trained on (e.g. a test split): the membership attack's "
                   "non-members [default: no membership reading].")
@click.option("--other", "other_path", default=None, type=click.Path(dir_okay=False),
              help="Another silo's data file: how much of its input directions the artifact's input factor spans, "
                   "beside the silo's own [default: not compared].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@max_memory_option
@handle_errors
def audit_cmd(file, data_path, holdout_path, other_path, as_json, max_memory):
    """What a client artifact reveals about its silo, before you share it: the stored label distribution,
    how much of the silo's input statistics the first layer's K-FAC input factor holds, and a membership
    attack (loss threshold) against its networks. Changes nothing; no privacy mechanism is applied."""
    from posterior_fusion.artifact import load_client
    from posterior_fusion.local.audit import audit, describe

    art = load_client(file, max_memory)
    classes = art.model_spec.num_classes
    read = lambda p: None if p is None else read_silo(p, num_classes=classes, max_memory=max_memory)  # noqa: E731
    report = audit(art, read(data_path), read(holdout_path), read(other_path))
    if as_json:
        echo_json(report)
    else:
        for line in describe(report):
            say(line)
