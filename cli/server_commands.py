"""``pfuse fuse``, ``pfuse evaluate``, ``pfuse predict``, ``pfuse demo``. The options come from torch-free
declarations (the registry's names, :mod:`posterior_fusion.choices`); fusion, prediction and the demo's
pipeline are imported when a command runs, so ``--help`` starts without torch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from posterior_fusion.cli.common import (
    echo_json,
    handle_errors,
    log_to_stderr,
    max_memory_option,
    old_spellings,
    say,
    setting_options,
)
from posterior_fusion.compat import FUSE_FLAGS_TO_SETTINGS
from posterior_fusion.data.silo import read_silo
from posterior_fusion.errors import ConfigError
from posterior_fusion.files import check_output, output_lock
from posterior_fusion.fusion.distill_settings import RecipeChoice, TeachingConfig
from posterior_fusion.fusion.options import FusionOptions, ServerSteps
from posterior_fusion.fusion.registry import (
    DEFAULT_METHOD,
    DEFAULT_SETTINGS,
    METHODS,
    get_method,
    resolve_default,
)
from posterior_fusion.fusion.settings_parsing import parse_pairs
from posterior_fusion.predictive_settings import CalibrationSettings, PredictiveSettings
from posterior_fusion.settings import choice_help


def legacy_settings(fn: Callable) -> Callable:
    """Accept the pre-``--set`` flags (:data:`posterior_fusion.compat.FUSE_FLAGS_TO_SETTINGS`) until
    their removal: each warns and becomes a setting (dropped, with a warning, for a method whose
    record lacks it)."""
    table = {flag: (key, {"int": int, "float": float}[t]) for flag, (key, t) in FUSE_FLAGS_TO_SETTINGS.items()}
    dests = {flag: "legacy_" + flag.lstrip("-").replace("-", "_") for flag in table}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        legacy = {}
        for flag, dest in dests.items():
            value = kwargs.pop(dest)
            if value is not None:
                key = table[flag][0]
                say(f"warning: {flag} is deprecated; use --set {key}={value}", err=True)
                legacy[key] = value
        return fn(*args, legacy=legacy, **kwargs)

    for flag, dest in dests.items():
        wrapper = click.option(flag, dest, hidden=True, default=None, type=table[flag][1])(wrapper)
    return wrapper


def parse_floats(text: str, option: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"{option} must be a comma list of numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ConfigError(f"{option} needs positive numbers, got {text!r}")
    return values


def method_help(name: str) -> str:
    entry = get_method(name)
    lines = [f"{name}: {entry.summary}", "settings (pfuse fuse --method NAME --set key=value):"]
    rows = entry.settings.describe()
    if not rows:
        lines.append("  (none)")
    for row in rows:
        allowed = (choice_help(row["choice_docs"]) if row.get("choices")
                   else f" (range: {row['bounds'][0]:g} to {row['bounds'][1]:g})" if row.get("bounds") else "")
        lines.append(f"  {row['name']:<15} {row['type']:<12} {row['help']}{allowed} [default: {row['default']}]")
    return "\n".join(lines)


SETTINGS_EPILOG = ("Each method's own settings, their defaults and ranges: pfuse fuse --help-method NAME "
                   "(set them with --set key=value).")


def show_method_help(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    if value not in METHODS:
        raise click.BadParameter(f"unknown method {value!r}; available: {', '.join(METHODS)}")
    say(method_help(value))
    ctx.exit(0)


distill_options = setting_options(TeachingConfig, prefix="distill", text=True, help_prefix="consistent recipe: ")
fusion_options = setting_options(FusionOptions, skip=("progress",))


@click.command("fuse", epilog=SETTINGS_EPILOG)
@click.argument("clients", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--method", default=None, type=click.Choice(list(METHODS)),
              help="Fusion method [default: the one docs/choosing.md recommends when nothing else is known: "
                   f"{DEFAULT_METHOD} with {', '.join(f'{k}={v}' for k, v in DEFAULT_SETTINGS.items())}].")
@click.option("--set", "set_values", multiple=True, metavar="KEY=VALUE",
              help="A setting of the chosen method, repeatable (list them with --help-method NAME), "
                   "e.g. --set steps=300 --set adam_lr=1e-3 [default: the method's defaults].")
@click.option("--help-method", callback=show_method_help, expose_value=False, is_eager=True, metavar="NAME",
              help="Describe a method and list its settings with their defaults, then exit.")
@click.option("--out", type=click.Path(dir_okay=False), help="Output global artifact (HDF5); required unless "
                                                            "--dry-run.")
@click.option("--val", "val_path", default=None, type=click.Path(dir_okay=False),
              help="Server validation data: Adam keeps its best validation iterate per mode [default: none; Adam "
                   "then keeps its best objective, and fedbens' default solver=auto on kron curvature runs its "
                   "stationary, validation-free fusion instead].")
@click.option("--unlabeled", default=None, type=click.Path(dir_okay=False),
              help="Unlabeled server data (labels not needed): fedbe's and --distill's distillation set.")
@click.option("--distill", is_flag=True,
              help="Serve one network: teach it what the fused predictive knows (--distill-recipe), on --unlabeled, "
                   "or without server inputs on inputs synthesised from the artifacts; an interrupted run resumes "
                   "from OUT.distill-partial when run again with the same settings [default: no distillation].")
@setting_options(RecipeChoice, prefix="distill")
@distill_options
@fusion_options
@setting_options(ServerSteps)
@click.option("--dry-run", is_flag=True,
              help="Validate the clients' headers and say what the fusion will hold (artifacts on disk, their data "
                   "once loaded, the working-set estimate against the memory limit), then stop: nothing is fused or "
                   "written.")
@max_memory_option
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON summary: out, method, members, fuse_seconds, settings and, where they apply, resolved "
                   "(what 'auto' settings became) and members_from_starts (the start rows of each member).")
@legacy_settings
@old_spellings("fuse")
@handle_errors
def fuse_cmd(clients, method, set_values, out, val_path, unlabeled, distill, distill_recipe, distill_epochs,
             temperature, prior_var, component, sampling_seed, kernel, device, batchnorm_statistics,
             allow_mixed_privacy, tune, tune_temperatures, tune_prior_vars, robust, dry_run, max_memory, as_json,
             legacy, **teaching):
    """Validate client artifacts and fuse them into a global ensemble."""
    from posterior_fusion.fusion import applicable_settings

    method, defaults = resolve_default(method, None)
    overrides = {**defaults, **applicable_settings(method, legacy)}
    for k in sorted(set(legacy) - set(overrides)):
        log_to_stderr(f"warning: method {method!r} has no setting {k!r}; ignored")
    overrides.update(parse_pairs(set_values))
    if distill_epochs is not None and "distill_epochs" in applicable_settings(method, {"distill_epochs": 0}):
        overrides["distill_epochs"] = distill_epochs
    if dry_run:
        from posterior_fusion.fusion.from_files import plan_fusion
        from posterior_fusion.fusion.tuning import parse_tune

        plan = plan_fusion(list(clients), method, overrides, val_path, unlabeled, max_memory, robust, parse_tune(tune),
                           distill_config(distill, distill_recipe, distill_epochs, teaching, unlabeled))
        if as_json:
            echo_json(plan)
            return
        limit = plan["memory_limit_bytes"]
        say(f"dry run: {plan['clients']} client headers valid; {method} will hold about "
            f"{plan['memory_estimate_bytes'] / 2**20:.1f} MiB (the clients' data {plan['data_bytes'] / 2**20:.1f} MiB "
            f"once loaded, {plan['artifact_bytes'] / 2**20:.1f} MiB on disk"
            + ("; their curvature read one client at a time" if plan["curvature_folded"] else ""
               if plan["curvature_kept"] else "; their curvature checked block by block, not kept") + ")"
            + (f", within the limit of {limit / 2**20:.0f} MiB" if limit else "") + "; nothing fused or written")
        return
    if out is None:
        raise click.UsageError("Missing option '--out'.")
    with output_lock(out, inputs=[*clients, val_path, unlabeled]):
        _fuse_to_file(clients, method, overrides, out, val_path, unlabeled, temperature, prior_var, component,
                      sampling_seed, kernel, device, tune, tune_temperatures, tune_prior_vars, robust, max_memory,
                      as_json, distill_config(distill, distill_recipe, distill_epochs, teaching, unlabeled),
                      batchnorm_statistics, allow_mixed_privacy)


def distill_config(distill: bool, recipe: str, epochs: int | None, given: dict, unlabeled):
    """The distillation record of ``fuse --distill`` from its options
    (:func:`~posterior_fusion.fusion.distill.distill_config`); a recipe's option given without --distill is
    refused in one line."""
    from posterior_fusion.fusion.distill import distill_config as from_settings

    chosen = {k.removeprefix("distill_"): v for k, v in given.items() if v is not None}
    if not distill:
        if chosen:
            raise ConfigError(f"--distill-{next(iter(chosen)).replace('_', '-')} applies with --distill only")
        return None
    return from_settings(RecipeChoice(recipe, epochs), chosen, bool(unlabeled))


def distill_checkpoint(out) -> Path:
    """Where ``fuse --distill --out OUT`` keeps the teaching's state until OUT is written (``OUT.distill-partial``):
    a run interrupted before resumes from it (``posterior_fusion/fusion/teaching_checkpoint.py``)."""
    return Path(str(out) + ".distill-partial")


def _fuse_to_file(clients, method, overrides, out, val_path, unlabeled, temperature, prior_var, component,
                  sampling_seed, kernel, device, tune, tune_temperatures, tune_prior_vars, robust, max_memory,
                  as_json, distill=None, batchnorm_statistics: str = "fold", allow_mixed_privacy: bool = False) -> None:
    from posterior_fusion.fusion import FusionOptions, fuse, write_fused
    from posterior_fusion.fusion.tuning import parse_tune

    opts = FusionOptions(temperature=temperature, prior_var=prior_var, component=component,
                         sampling_seed=sampling_seed, kernel=kernel, device=device,
                         batchnorm_statistics=batchnorm_statistics, allow_mixed_privacy=allow_mixed_privacy)
    inputs, result, meta = fuse(list(clients), method, opts, overrides, val_path, unlabeled, log=log_to_stderr,
                                robust=robust, max_memory=max_memory, tune=parse_tune(tune),
                                tune_temperatures=parse_floats(tune_temperatures, "--tune-temperatures"),
                                tune_prior_vars=parse_floats(tune_prior_vars, "--tune-prior-vars"), distill=distill,
                                distill_checkpoint=distill_checkpoint(out))
    if "tuning" in meta:
        chosen = meta["tuning"]["chosen"]
        say(f"tuned: T={chosen['temperature']} prior_var={chosen['prior_var']} "
                   f"(val accuracy {chosen['val_accuracy']:.4f})")
    write_fused(out, inputs, result, meta)
    distill_checkpoint(out).unlink(missing_ok=True)
    if as_json:
        echo_json({"out": out, "method": method, "members": len(result.members), "fuse_seconds": meta["fuse_seconds"],
                   "settings": meta["settings"],
                   **{k: meta[k] for k in ("resolved", "members_from_starts") if k in meta}})
        return
    say(f"wrote {out}: {method}, {len(result.members)} members, {meta['fuse_seconds']:.1f}s")
    if "resolved" in meta:  # what a method's 'auto' settings became
        say("  ran with " + ", ".join(f"{k}={v}" for k, v in meta["resolved"].items()))
    merged = meta.get("members_from_starts")
    if merged:  # several starts ended on one mode: one member each (what a reader of the history needs)
        say(f"  {sum(map(len, merged))} starts reached {len(merged)} distinct modes; each is one member weighted by its "
            "starts' share (members_from_starts)")
    for k, hist in enumerate(meta.get("history", [])):
        best = max(hist, key=lambda h: h.get("val_accuracy", -h["objective"]))
        extra = f" val acc {best['val_accuracy']:.4f}" if "val_accuracy" in best else ""
        say(f"  {'start' if merged else 'mode'} {k}: best step {best['step']} objective {best['objective']:.6g}{extra}")


def with_predictive_options(fn):
    """The options of the predictive a global serves (:class:`~posterior_fusion.predictive_settings.PredictiveSettings`)
    and the validation file that may choose its scale."""
    fn = click.option("--scale-from", "scale_from", default=None, type=click.Path(dir_okay=False),
                      help="Choose --scale on this labelled validation file (lowest NLL over 1e-4..1) [default: use "
                           "--scale].")(fn)
    return setting_options(PredictiveSettings)(fn)


def _scale(g, predictive, samples, link, scale, scale_from, max_memory) -> tuple[float, list[dict]]:
    from posterior_fusion.metrics import check_data, choose_scale

    if scale_from is None or predictive == "map":
        return scale, []
    val = read_silo(scale_from, num_classes=g.model_spec.num_classes, max_memory=max_memory)
    check_data(g.model_spec, val, len(g.members), max_memory, g.metadata.get("input_transform"), g.path)
    chosen, table = choose_scale(g, val, predictive, samples, link)
    log_to_stderr(f"{g.path}: predictive scale {chosen:g} chosen on {scale_from} (lowest validation NLL)")
    return chosen, table


def check_global_headers(paths) -> None:
    """Each global artifact's header and structure, read without torch (:func:`~posterior_fusion.artifact.preview.
    artifact_kind`): a forged or mistaken file is refused in one line before torch is imported."""
    from posterior_fusion.artifact.preview import artifact_kind
    from posterior_fusion.errors import SchemaError

    for path in paths:
        if artifact_kind(path) != "global":
            raise SchemaError(str(path), "expected a global artifact (from fuse), got a client one", "/")


@click.command("evaluate")
@click.argument("global_artifacts", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False), help="Labelled data file (e.g. test.h5).")
@with_predictive_options
@click.option("--ood", default=None, type=click.Path(dir_okay=False),
              help="Out-of-distribution data file: adds the OOD AUROC from predictive entropy [default: none].")
@setting_options(CalibrationSettings)
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="Reliability + accuracy–coverage figure of every artifact (.png, .pdf or .svg) [default: none].")
@click.option("--json", "as_json", is_flag=True, help="Print metrics as JSON.")
@max_memory_option
@handle_errors
def evaluate_cmd(global_artifacts, data_path, predictive, samples, link, scale, scale_from, ood, bins, plot, as_json,
                 max_memory):
    """Accuracy, NLL, ECE/MCE, Brier, entropy, AUROC(correct), selective accuracy (and OOD AUROC) of global artifacts."""
    check_global_headers(global_artifacts)
    from posterior_fusion.artifact import load_global
    from posterior_fusion.metrics import evaluate_posterior, reliability_plot

    if plot:
        check_output(plot, inputs=[*global_artifacts, data_path, ood, scale_from])
    results = []
    for path in global_artifacts:
        g = load_global(path, max_memory)
        data = read_silo(data_path, num_classes=g.model_spec.num_classes, max_memory=max_memory)
        ood_data = read_silo(ood, num_classes=g.model_spec.num_classes, max_memory=max_memory) if ood else None
        chosen, tuning = _scale(g, predictive, samples, link, scale, scale_from, max_memory)
        m = evaluate_posterior(g, data, predictive, samples, chosen, link, bins, ood_data, max_memory)
        if tuning:
            m["scale_tuning"] = {"file": scale_from, "grid": tuning}
        results.append((path, g, m))
    if plot:
        reliability_plot([(f"{g.method} [{predictive}]", m) for _, g, m in results], plot, dataset=data_path)
    if as_json:
        rows = [{"file": p, "method": g.method, **m} for p, g, m in results]
        echo_json(rows[0] if len(rows) == 1 else rows)
        return
    for path, g, m in results:
        extra = f"  OOD AUROC {m['ood_auroc']:.4f}" if "ood_auroc" in m else ""
        members = (f"members {m['num_members']} (single-member accuracy {m['member_accuracy_min']:.4f}.."
                   f"{m['member_accuracy_max']:.4f})" if "member_accuracy_min" in m else f"modes {m['num_members']}")
        a = m["auroc_correct"]
        auroc = (f"{a:.4f}" if a == a else  # NaN: one of the two groups is empty
                 f"n/a (every prediction {'right' if m['accuracy'] == 1 else 'wrong'}: no pair to rank)")
        say(f"{g.method} [{predictive}]: accuracy {m['accuracy']:.4f}  NLL {m['nll']:.4f}  ECE {m['ece']:.4f}  "
                   f"MCE {m['mce']:.4f}  Brier {m['brier']:.4f}  entropy {m['entropy_mean']:.3f}  "
                   f"AUROC(correct) {auroc}{extra}  {members}  n={m['n']}  ({path})")


@click.command("predict")
@click.argument("global_artifact", type=click.Path(dir_okay=False))
@click.option("--data", "data_path", required=True, type=click.Path(dir_okay=False), help="Data file with /x.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output HDF5 with /probs (n, classes).")
@with_predictive_options
@max_memory_option
@handle_errors
def predict_cmd(global_artifact, data_path, out, predictive, samples, link, scale, scale_from, max_memory):
    """Write the predictive class probabilities (map ensemble, mc or glm)."""
    check_global_headers([global_artifact])
    from posterior_fusion.artifact import load_global
    from posterior_fusion.artifact.writer import write_predictions
    from posterior_fusion.metrics import check_data

    check_output(out, inputs=[global_artifact, data_path, scale_from])
    g = load_global(global_artifact, max_memory)
    data = read_silo(data_path, num_classes=g.model_spec.num_classes, max_memory=max_memory, labels=False)
    check_data(g.model_spec, data, len(g.members), max_memory, g.metadata.get("input_transform"), g.path)
    scale, _ = _scale(g, predictive, samples, link, scale, scale_from, max_memory)
    probs = g.predict(data.inputs(), predictive, samples, scale, link, max_memory=max_memory, raw=True)
    names = list(g.metadata.get("class_names") or data.class_names or [])
    write_predictions(out, probs, {"global_sha256": g.sha256, "predictive": predictive, "scale": scale}, names)
    say(f"wrote {out}: probabilities {tuple(probs.shape)} and the predicted class of each row ({predictive})"
        + (f", class names {', '.join(names[:4])}{', …' if len(names) > 4 else ''}" if names else ""))
