"""``pfuse inspect``."""

from __future__ import annotations

import click

from posterior_fusion.artifact.preview import preview
from posterior_fusion.artifact.schema import COMPRESSION_UNRECORDED
from posterior_fusion.cli.common import echo_json, handle_errors, max_memory_option, say


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _num(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


@click.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (with --validate: the loaded "
                                                      "artifact's full summary).")
@click.option("--validate", is_flag=True, help="Also read and check every value as fuse reads the file (the model "
                                               "spec against the layout, finiteness, factor symmetry, the privacy "
                                               "record against Opacus' accountant); imports torch.")
@max_memory_option
@handle_errors
def inspect_cmd(file, as_json, validate, max_memory):
    """Summarise an artifact (model, layout, structure, sizes, metadata) from its header.

    The header is read without torch, at once: its attributes typed and size-capped, every HDF5
    object a plain group or dataset on the schema's paths. --validate then checks the whole file,
    values included, as fuse reads it. A bad file ends with one line and exit 2 either way.
    A data file (from import-data or partition) is described and validated whole: samples, shape,
    classes, transform."""
    from posterior_fusion.data.silo import describe_data, is_data_file

    if is_data_file(file):
        d = describe_data(file, max_memory)
        if as_json:
            echo_json(d)
            return
        say(f"{file}  (data file: {d['n']} samples of {tuple(d['input_shape'])}, stored as {d['stored_dtype']}, "
            f"dataset {d['dataset']!r})")
        say(f"classes: {d['num_classes']}  " + (f"counts {d['class_counts']}" if d["labelled"] else "unlabelled"))
        if d.get("class_names"):
            say(f"class names: {', '.join(d['class_names'][:20])}{', …' if len(d['class_names']) > 20 else ''}")
        t = d["input_transform"]
        parts = [f"{k} " + (f"({len(v)} values: {', '.join(f'{x:.4g}' for x in v[:3])}, …)" if isinstance(v, (list, tuple))
                            and len(v) > 3 else str(v)) for k, v in t.items()]
        say(f"input transform: {'; '.join(parts)}")
        say("validated: the whole file, values included")
        return
    if as_json and validate:
        from posterior_fusion.artifact import load
        from posterior_fusion.summary import summarize

        echo_json(summarize(load(file, max_memory)))
        return
    s = preview(file)
    if as_json:
        echo_json({**s, "validated": "header"})
        return
    say(f"{s['file']}  ({s['kind']} artifact, {_bytes(s['file_bytes'])}, sha256 {s['sha256'][:16]}…)")
    tuned = f"  fine-tuning {s['model']['finetune']} of a base (frozen weights stored once)" \
        if s["model"].get("finetune") else ""
    say(f"model: {s['model'].get('name', '?')} {s['model'].get('kwargs', {})}  parameters d={s['num_params']}{tuned}")
    say("layout:")
    for e in s["layout"]:
        say(f"  {e['name']:<14} {str(tuple(e['shape'])):<18} offset {e['offset']}")
    meta = s["metadata"]
    if meta.get("partial"):
        say("PARTIAL: an interrupted fit-local run (finish it with --resume); fuse refuses it")
    if s["kind"] == "client":
        say(f"structure: {s['structure']}  n_data={meta.get('n_data')}  T={meta.get('temperature')}  "
                   f"λ0={meta.get('prior_precision')}  class counts {meta.get('class_counts')}")
        if isinstance(meta.get("dp"), dict):
            d = meta["dp"]
            say(f"differential privacy, as recorded (checked below): (ε, δ) = ({d.get('epsilon', float('nan')):.3g}, {d.get('delta', float('nan')):.3g}) "
                f"for the whole artifact (target ε {d.get('target_epsilon')}; DP-SGD noise {d.get('noise_multiplier', 0):.3g}, "
                f"clip {d.get('clip')}; curvature and counts noise {d.get('release_noise', 0):.3g})")
            for p in d.get("passes") or []:
                if isinstance(p, dict):
                    say(f"  also at that noise: {p.get('part')}, {p.get('steps')} steps at sampling rate "
                        f"{p.get('sample_rate', float('nan')):.3g}")
        refresh = meta.get("refreshed_at")
        if isinstance(refresh, dict) and isinstance(refresh.get("dp"), dict):
            d = refresh["dp"]
            say(f"refresh round: private, (ε, δ) = ({d.get('epsilon', float('nan')):.3g}, {d.get('delta', float('nan')):.3g}) "
                f"over its {d.get('releases')} release(s) (gradient noise {d.get('noise_multiplier', 0):.3g} × clip "
                f"{d.get('clip')}; the curvature is the fit's own)")
        elif isinstance(refresh, dict):
            say("refresh round: exact release (no privacy mechanism: the gradient and curvature at the server's points)")
        say("prior: " + ("N(base, 1/λ0), centred at the pretrained base the silo fine-tuned" if s["prior_centre"] == "base"
                         else "N(0, 1/λ0), centred at zero"))
        if meta.get("batchnorm") == "fold":
            say("BatchNorm: trained from random starting points; each component's statistics estimated on the silo "
                "and folded into its affine parameters (stored per component for fuse --batchnorm-statistics reset)")
        if meta.get("class_names"):
            names = list(meta["class_names"])
            say(f"class names: {', '.join(map(str, names[:20]))}{', …' if len(names) > 20 else ''}")
        if meta.get("compress"):
            say(f"compressed: budget {meta['compress']} ({meta.get('compress_metric', COMPRESSION_UNRECORDED['compress_metric'])}), eigenvectors "
                f"{meta.get('compress_vectors', COMPRESSION_UNRECORDED['compress_vectors'])}")
        policy = meta.get("curvature_blocks")
        if isinstance(policy, dict):
            kinds: dict[str, list[str]] = {}
            for name, kind in policy.items():
                kinds.setdefault(str(kind), []).append(str(name))
            say("curvature per parameter: " + ", ".join(f"{kind} {len(names)}" for kind, names in sorted(kinds.items())))
            if "prior" in kinds:
                names = kinds["prior"]
                say(f"  no curvature, the prior alone: {', '.join(names[:6])}{', …' if len(names) > 6 else ''}")
        say("components:")
        for c in s["components"]:
            t = c["training"] if isinstance(c["training"], dict) else {}
            say(f"  [{c['index']}] blocks {c['blocks']}  curvature {_bytes(c['curvature_bytes'])} "
                       f"({c['curvature_bytes_per_param']}x params)  swag K={c['swag_rank']}"
                       f"{'  ppd student' if c['ppd_student'] else ''}  "
                       f"loss {_num(t.get('final_loss'), '.4f')} acc {_num(t.get('final_accuracy'), '.3f')}")
    else:
        say(f"method: {s['method']}  members: {s['num_members']}")
        rule = meta.get("batchnorm_statistics")
        if isinstance(rule, dict):
            say(f"BatchNorm statistics: {rule.get('rule')}" + (f" (estimated on {rule.get('n')} inputs of "
                                                              f"{rule.get('file')})" if rule.get("rule") == "reset" else
                                                              " (the fused affine maps as fused)"))
        for key in sorted(meta):
            if key not in ("history",):
                say(f"  {key}: {meta[key]}")
    if not validate:
        say("checked: the header and the file's structure (--validate checks every value as fuse reads them)")
        return
    from posterior_fusion.artifact import load  # imports torch: after the summary is on screen

    art = load(file, max_memory)
    say("validated: the whole file, values included (as fuse reads it)")
    if s["kind"] == "client" and isinstance(meta.get("dp"), dict):
        try:
            import opacus  # noqa: F401 - the reader recomputed the recorded ε with its accountant
            say("privacy record: its ε is what its recorded mechanisms give under Opacus' accountant; the mechanisms "
                "themselves are the silo's word (claimed, not provable from the file)")
        except ImportError:
            say("privacy record: claimed (Opacus is not installed here: its ε was not recomputed)")
    if s["kind"] == "client" and meta.get("compress"):
        from posterior_fusion.summary import compression_errors

        rows = compression_errors(art)
        bound = rows and rows[0]["precision_metric_is_bound"]
        say("compression error per layer, worst component: recorded (" + meta.get("compress_metric", COMPRESSION_UNRECORDED["compress_metric"])
            + " metric) and what fusion sees (precision metric: each eigenvalue of G/T + λ0·I within "
            "×(1 ± e_B)(1 ± e_A)" + (", here an upper bound from the Frobenius record)" if bound else ")") + ":")
        for r in rows:
            (eb, ea), (pb, pa) = r["recorded"], r["precision_metric"]
            say(f"  {r['name']:<14} {str(tuple(r['shape'])):<12} rank {r['rank'][0]}/{r['rank'][1]}  "
                f"recorded B {eb:.3g} A {ea:.3g}  precision B {pb:.3g} A {pa:.3g}")
