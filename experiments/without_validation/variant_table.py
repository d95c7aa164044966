"""Every fusion variant without validation data (today's default, the
validation-free candidates, with and without the refresh round) with every predictive of items 3-4,
on one client set: accuracy, NLL, ECE, OOD AUROC (scikit-learn's digits resized, as
``predictive_fmnist.py``), server seconds, and each predictive's evaluation seconds and peak memory
(``pfuse evaluate`` in a fresh process: its wall seconds include the start-up, its peak is VmHWM).

    nice -n 5 .venv/bin/python experiments/without_validation/variant_table.py --clients DIR --out OUTDIR

DIR as for ``refresh_round.py`` (client_*.h5, post_*.h5, server_val.h5, test.h5). Refreshed client
artifacts already in DIR/refresh (written by ``refresh_round.py`` with the same code) are reused:
``at_paper_d1.0_post_*.h5`` (one round at the paper's modes) and ``at_em_post_*.h5`` (at the EM
modes); missing ones are computed here (``pfuse refresh``, damping 1, or auto for the variant that says
so). Writes OUTDIR/rows.json.
The trust region is left out: 20-35x EM's time and below plain EM at every radius
(``docs/results/without_validation/trust_lenet_*.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.artifact.reader import load_client, load_global
from posterior_fusion.data.silo import read_silo
from posterior_fusion.experiment.measure import digits_ood, run_measured, save_rows
from posterior_fusion.fusion import FusionOptions, fuse, write_fused
from posterior_fusion.local.refresh import refresh as refresh_artifact

# (file name, label, client set, method, settings, the fusion uses the validation split); "paper" and
# "em" are the one-shot globals the refreshed client sets are taken at
VARIANTS = [
    ("paper", "one-shot, adam, best validation iterate (today's default)", "one-shot", "fedbens", {}, True),
    ("adam", "one-shot, adam, best objective", "one-shot", "fedbens", {"solver": "adam"}, False),
    ("em", "one-shot, em (stationary)", "one-shot", "fedbens", {"solver": "em"}, False),
    ("em_damped", "one-shot, em, damping 0.0316", "one-shot", "fedbens", {"solver": "em", "damping": 0.0316}, False),
    ("refreshed_em", "refreshed at the paper's modes, em", "at_paper_d1.0", "fedbens", {"solver": "em"}, False),
    ("refreshed_paper", "refreshed at the paper's modes, adam, best validation iterate", "at_paper_d1.0", "fedbens",
     {}, True),
    ("em_refresh_em", "em -> refresh -> em (no validation anywhere)", "at_em", "fedbens", {"solver": "em"}, False),
    # the over-counted prior divided out at each mode's client average (fedbens prior_centre=clients)
    ("centred_paper", "one-shot, adam, prior centre clients, best validation iterate", "one-shot", "fedbens",
     {"prior_centre": "clients"}, True),
    ("centred_adam", "one-shot, adam, prior centre clients, best objective", "one-shot", "fedbens",
     {"prior_centre": "clients", "solver": "adam"}, False),
    ("centred_em", "one-shot, em, prior centre clients (stationary)", "one-shot", "fedbens",
     {"solver": "em", "prior_centre": "clients"}, False),
    ("centred_em_refresh_em", "em -> refresh -> em, prior centre clients (no validation anywhere)", "at_centred_em",
     "fedbens", {"solver": "em", "prior_centre": "clients"}, False),
    # the same, each silo choosing the centre step's damping by its gain ratio (recapture --damping auto)
    ("centred_em_refresh_auto_em", "em -> refresh (damping auto) -> em, prior centre clients (no validation anywhere)",
     "at_centred_em_auto", "fedbens", {"solver": "em", "prior_centre": "clients"}, False),
    ("ensemble", "client ensemble", "one-shot", "ensemble", {}, False),
    # the Laplace approximation's prior precision from the modes' evidence (fedbens laplace_prior=evidence):
    # the same modes as the rows above, another covariance for mc / glm
    ("paper_evidence", "one-shot, adam, best validation iterate, Laplace prior from the evidence", "one-shot",
     "fedbens", {"laplace_prior": "evidence"}, True),
    ("centred_em_refresh_auto_em_evidence", "em -> refresh (damping auto) -> em, prior centre clients, Laplace prior "
     "from the evidence (no validation anywhere)", "at_centred_em_auto", "fedbens",
     {"solver": "em", "prior_centre": "clients", "laplace_prior": "evidence"}, False),
    # the server prior's precision λ0 from the Laplace evidence of the server's model (fedbens server_prior=evidence):
    # how hard the stationary modes are pulled to the clients' average, chosen without data
    ("centred_em_evidence", "one-shot, em, prior centre clients, server prior evidence (stationary)", "one-shot",
     "fedbens", {"solver": "em", "prior_centre": "clients", "server_prior": "evidence"}, False),
    ("centred_em_evidence_refresh_auto_em_evidence", "em -> refresh (damping auto) -> em, prior centre clients, "
     "server prior evidence (no validation anywhere)", "at_centred_em_evidence_auto", "fedbens",
     {"solver": "em", "prior_centre": "clients", "server_prior": "evidence"}, False),
]
# refreshed client set -> the global it is taken at, and the recapture's damping
REFRESH_SOURCES = {"at_paper_d1.0": "paper", "at_em": "em", "at_centred_em": "centred_em", "at_centred_em_auto": "centred_em",
                   "at_centred_em_evidence_auto": "centred_em_evidence"}
REFRESH_DAMPINGS = {"at_centred_em_auto": "auto", "at_centred_em_evidence_auto": "auto"}  # the others: 1 (the default before "auto")
# (label, evaluate options, needs a Laplace posterior at the modes, only where the fusion used validation)
PREDICTIVES = [
    ("map", ["--predictive", "map"], False, False),
    ("mc, scale 1", ["--predictive", "mc", "--samples", "30"], True, False),
    ("glm (probit), scale 1", ["--predictive", "glm"], True, False),
    ("mc, scale chosen on validation NLL", ["--predictive", "mc", "--samples", "30", "--scale-from", None], True, True),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated short names of the variants to run (default: all)")
    args = ap.parse_args()
    only = [t for t in args.only.split(",") if t]
    folder, out = Path(args.clients), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    posts = sorted(folder.glob("post_*.h5"))
    silos = [folder / f"client_{p.stem.split('_')[1]}.h5" for p in posts]
    val, test = folder / "server_val.h5", folder / "test.h5"
    ood = out / "digits_ood.h5"
    if not ood.exists():
        digits_ood(ood)
    done = json.loads((out / "rows.json").read_text())["rows"] if (out / "rows.json").exists() else []
    rows = list(done)  # a stopped run resumes: its rows are kept, their fusions and evaluations not redone

    def client_set(name: str) -> list[Path]:
        if name == "one-shot":
            return posts
        found = [folder / "refresh" / f"{name}_{p.name}" for p in posts]
        if all(p.exists() for p in found):
            return found
        glob_path = out / f"{REFRESH_SOURCES[name]}.h5"
        found = [out / f"{name}_{p.name}" for p in posts]
        t0 = time.time()
        for p, s, o in zip(posts, silos, found):
            if o.exists():  # computed by an earlier run of this script
                continue
            source = load_client(p)
            meta, comps = refresh_artifact(source, read_silo(s, num_classes=source.model_spec.num_classes), load_global(glob_path), source.structure,
                                    log=lambda *_: None,
                                    damping=REFRESH_DAMPINGS.get(name, 1.0))
            write_client_artifact(o, source.model_spec, source.layout, meta, comps)
        print(f"refreshed {name} in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        return found

    for short, label, group, method, settings, use_val in VARIANTS:
        if only and short not in only:
            continue
        todo = [p for p in PREDICTIVES if not ((p[2] and method != "fedbens") or (p[3] and not use_val))
                and not any(r["variant"] == label and r["predictive"] == p[0] for r in done)]
        if not todo and (short not in REFRESH_SOURCES.values() or (out / f"{short}.h5").exists()):
            continue
        client_paths = client_set(group)  # a refresh computed here is silo time, not server time
        t0 = time.time()
        inputs, result, meta = fuse(client_paths, method, FusionOptions(progress=False), settings,
                                    val_path=val if use_val else None)
        server_seconds = round(time.time() - t0, 1)
        glob_path = out / f"{short}.h5"
        write_fused(glob_path, inputs, result, meta)
        for name, opts, _, _ in todo:
            opts = [str(val) if o is None else o for o in opts]
            m = run_measured("evaluate", glob_path, "--data", test, "--ood", ood, "--json", *opts)
            if m["exit"] != 0:
                raise SystemExit(f"{label} / {name}: {m['error']}")
            metrics = json.loads(m["stdout"])
            metrics = metrics[0] if isinstance(metrics, list) else metrics
            rows.append({"variant": label, "validation": use_val, "predictive": name, "members": len(result.members),
                         "server_seconds": server_seconds, "eval_seconds": m["seconds"], "eval_peak_mib": m["peak_mib"],
                         **{k: metrics.get(k) for k in ("accuracy", "nll", "ece", "ood_auroc", "scale")}})
            print(json.dumps(rows[-1]), flush=True)
            save_rows(str(out / "rows.json"), {"clients": str(folder), "rows": rows})


if __name__ == "__main__":
    main()
