"""The curvature-refresh round ("1.5-shot"). Each silo re-expands its tempered
log-posterior at the fused modes (``pfuse refresh --at GLOBAL``: GGN and gradient at w*, the
component becoming the Gauss–Newton Gaussian there) and the server fuses again. Side by side on
one client set: fedbens before the round (the paper's Adam with its best validation iterate; EM to
a stationary point without validation data), after one round (refreshed at the paper's modes, or
at the EM modes — a pipeline that never sees validation data) and after a second round; test
accuracy, NLL, ECE, server and silo seconds, and the bytes each round moves. The rounds release the exact
gradient and a new curvature (``refresh_dp_epsilon`` none) unless ``--refresh-dp-epsilon E`` asks for the
private round (the silo's own curvature, a noisy clipped gradient; ``pfuse recapture``'s default, ε = 1).

    nice -n 5 .venv/bin/python experiments/without_validation/refresh_round.py --clients DIR --json OUT.json

DIR holds ``post_*.h5`` (the fit-local artifacts) and ``client_*.h5`` (the silos), ``server_val.h5`` and
``test.h5`` (``pfuse partition`` + ``pfuse fit-local``), the data in DIR or in DIR/data (a ``pfuse demo`` folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.artifact.reader import load_client
from posterior_fusion.data.silo import read_silo
from posterior_fusion.experiment.measure import save_rows
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.local.refresh import check_damping
from posterior_fusion.local.refresh import refresh as refresh_artifact
from posterior_fusion.local.refresh_settings import refresh_privacy_from
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.posterior import GlobalEnsemble

PAPER = ("adam, best validation iterate", {}, True)
EM = ("em (stationary), no validation", {"solver": "em"}, False)
AFTER = [EM, ("adam, best objective, no validation", {}, False), PAPER]
DAMPINGS = ["0", "0.1", "0.3", "1", "3", "10", "auto"]  # the centre step's damping, swept at the paper's modes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dampings", default=",".join(DAMPINGS),
                    help="comma-separated dampings of the refresh at the paper's modes (numbers or auto)")
    ap.add_argument("--em-dampings", default="auto",
                    help="comma-separated dampings of the two rounds at the EM modes (numbers or auto)")
    ap.add_argument("--refresh-dp-epsilon", default="none",
                    help="the rounds' privacy: ε of the private round, or none (the exact release) [default: none]")
    ap.add_argument("--refresh-dp-clip", default=None,
                    help="the private round's per-sample gradient clip [default: recapture's, 1]")
    ap.add_argument("--no-em-pipeline", action="store_true",
                    help="leave out the refresh rounds at the EM modes (the validation-free pipeline)")
    args = ap.parse_args()
    privacy = refresh_privacy_from({"refresh_dp_epsilon": args.refresh_dp_epsilon,
                                    **({"refresh_dp_clip": args.refresh_dp_clip} if args.refresh_dp_clip else {})}, "")
    folder = Path(args.clients)
    work = folder / ("refresh" if not privacy.private else
                     f"refresh_dp{privacy.refresh_dp_epsilon:g}_clip{privacy.refresh_dp_clip:g}")
    work.mkdir(exist_ok=True)
    paths = sorted(folder.glob("post_*.h5"))
    data = folder / "data" if (folder / "data" / "test.h5").exists() else folder  # a `pfuse demo` folder: data/
    silos = [data / f"client_{p.stem.split('_')[1]}.h5" for p in paths]
    test, val = read_silo(data / "test.h5"), data / "server_val.h5"
    rows = []

    def run(label: str, client_paths, variant, extra: dict) -> GlobalEnsemble:
        name, settings, use_val = variant
        t0 = time.time()
        inputs, result, _ = fuse(client_paths, "fedbens", FusionOptions(progress=False), settings,
                                 val_path=val if use_val else None)
        seconds = time.time() - t0
        m = evaluate_members(inputs.spec, result.members, test)
        rows.append({"round": label, "fusion": name, "validation": use_val, "accuracy": m["accuracy"], "nll": m["nll"],
                     "ece": m["ece"], "members": len(result.members), "server_seconds": round(seconds, 1), **extra})
        print(json.dumps(rows[-1]), flush=True)
        first = inputs.clients[0]
        return GlobalEnsemble(label, f"{len(rows):064d}", first.model_spec, first.layout, {"method": "fedbens"},
                              tuple(result.members))

    def refresh(tag: str, at: GlobalEnsemble, damping: float | str) -> tuple[list[Path], dict]:
        out, t0, sent = [], time.time(), 0
        for p, s in zip(paths, silos):
            source = load_client(p)
            meta, comps = refresh_artifact(source, read_silo(s, num_classes=source.model_spec.num_classes), at, source.structure,
                                    log=lambda m, name=p.name: print(f"  {name}: {m}", file=sys.stderr, flush=True),
                                    damping=damping, privacy=privacy)
            out.append(work / f"{tag}_{p.name}")
            write_client_artifact(out[-1], source.model_spec, source.layout, meta, comps)
            sent += out[-1].stat().st_size
        failed = sum(c.training.get("gain_test") == "failed" for q in out for c in load_client(q).components)
        return out, {"damping": damping, "refresh_dp_epsilon": privacy.refresh_dp_epsilon,
                     "refresh_dp_clip": privacy.refresh_dp_clip if privacy.private else None,
                     "silo_seconds_total": round(time.time() - t0, 1),
                     "bytes_up_per_client": sent // len(paths), "gain_test_failed": failed}

    base = {"silo_seconds_total": 0.0, "bytes_up_per_client": sum(p.stat().st_size for p in paths) // len(paths)}
    paper = run("one-shot", paths, PAPER, base)
    em = run("one-shot", paths, EM, base)
    for d in [check_damping(t, "--dampings") for t in args.dampings.split(",")]:
        at_paper, cost = refresh(f"at_paper_d{d}", paper, d)
        for variant in AFTER if d in (1.0, "auto") else AFTER[:2]:
            run("refreshed at the paper's modes", at_paper, variant, cost)
    if not args.no_em_pipeline:
        for d in [check_damping(t, "--em-dampings") for t in args.em_dampings.split(",")]:
            at_em, cost = refresh(f"at_em_d{d}", em, d)
            em2 = run("refreshed at the EM modes (no validation anywhere)", at_em, EM, cost)
            at_em2, cost = refresh(f"at_em2_d{d}", em2, d)
            run("second round at the EM modes (no validation anywhere)", at_em2, EM, cost)
    save_rows(args.json, {"clients": [str(p) for p in paths], "rows": rows})


if __name__ == "__main__":
    main()
