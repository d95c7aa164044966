"""Fusion that does not depend on early-stopping luck. Side by side on one client
set: fedbens as the paper runs it (Adam, best validation iterate), Adam without validation data
(best objective) and run further, the EM solver (a stationary point by construction) with and
without damping of the client curvature, FedLPA, and the client ensemble; test accuracy, NLL, ECE
and server seconds.

    nice -n 5 .venv/bin/python experiments/without_validation/fusion_safety.py --clients DIR --json OUT.json

DIR holds ``post_*.h5``, ``server_val.h5`` and ``test.h5`` (``pfuse partition`` + ``pfuse fit-local``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from posterior_fusion.data.silo import read_silo
from posterior_fusion.experiment.measure import save_rows
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.metrics import evaluate_members

VARIANTS = [  # (label, method, settings, uses validation data)
    ("fedbens adam, best validation iterate (paper)", "fedbens", {"solver": "adam"}, True),
    ("fedbens adam, no validation (best objective)", "fedbens", {"solver": "adam"}, False),
    ("fedbens adam 1,000 steps, no validation", "fedbens", {"steps": 1000, "solver": "adam"}, False),
    ("fedbens em (stationary)", "fedbens", {"solver": "em"}, False),
    ("fedbens em, damping 0.01", "fedbens", {"solver": "em", "damping": 0.01}, False),
    ("fedbens em, damping 0.0316", "fedbens", {"solver": "em", "damping": 0.0316}, False),
    ("fedbens em, damping 0.1", "fedbens", {"solver": "em", "damping": 0.1}, False),
    ("fedbens adam, damping 0.0316, best validation iterate", "fedbens", {"damping": 0.0316, "solver": "adam"}, True),
    ("fedbens em, trust radius 0.01", "fedbens", {"solver": "em", "trust_radius": 0.01}, False),
    ("fedbens em, trust radius 0.1", "fedbens", {"solver": "em", "trust_radius": 0.1}, False),
    ("fedbens em, trust radius 1", "fedbens", {"solver": "em", "trust_radius": 1.0}, False),
    ("fedbens em, trust radius 10", "fedbens", {"solver": "em", "trust_radius": 10.0}, False),
    ("fedbens adam, prior centre clients, best validation iterate", "fedbens", {"prior_centre": "clients", "solver": "adam"}, True),
    ("fedbens adam, prior centre clients, no validation (best objective)", "fedbens", {"prior_centre": "clients", "solver": "adam"}, False),
    ("fedbens em, prior centre clients (stationary)", "fedbens", {"solver": "em", "prior_centre": "clients"}, False),
    ("fedbens em, prior centre clients, damping 0.0316", "fedbens",
     {"solver": "em", "prior_centre": "clients", "damping": 0.0316}, False),
    ("fedlpa (damping 0.0316)", "fedlpa", {}, False),
    ("fedfisher adam, best validation iterate", "fedfisher", {}, True),
    ("client ensemble", "ensemble", {}, False),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="semicolon-separated substrings of variant labels to leave out")
    ap.add_argument("--only", default="", help="semicolon-separated substrings: run only the variants with one")
    args = ap.parse_args()
    skip = [t for t in args.skip.split(";") if t]
    only = [t for t in args.only.split(";") if t]
    folder = Path(args.clients)
    paths = sorted(folder.glob("post_*.h5"))
    test = read_silo(folder / "test.h5")
    rows = []
    for label, method, settings, use_val in VARIANTS:
        if any(t in label for t in skip) or (only and not any(t in label for t in only)):
            continue
        t0 = time.time()
        inputs, result, _ = fuse(paths, method, FusionOptions(progress=False), settings,
                                 val_path=folder / "server_val.h5" if use_val else None)
        seconds = time.time() - t0
        m = evaluate_members(inputs.spec, result.members, test)
        rows.append({"variant": label, "method": method, "settings": settings, "validation": use_val,
                     "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "members": len(result.members),
                     "server_seconds": round(seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)
    save_rows(args.json, {"clients": [str(p) for p in paths], "rows": rows})


if __name__ == "__main__":
    main()
