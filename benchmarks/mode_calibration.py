"""Why the Bayesian predictive does not beat the MAP modes (issue 29, item 4): per global artifact, the
mixture's and each mode's confidence against its accuracy, and each mode's own predictive — `map` and `glm`
(probit) at the server's prior precision λ0 and at the Laplace evidence's δ (fedbens
``laplace_prior=evidence``, :func:`~posterior_fusion.fusion.mode_laplace.evidence_prior_precision`).

    .venv/bin/python benchmarks/mode_calibration.py --global G.h5 --data test.h5 --json OUT.json

One row per (scope, predictive, prior): scope ``mixture`` (the K modes, weights π) or ``mode k``; accuracy,
NLL, ECE (15 bins), mean confidence (the largest class probability) and the prior precision used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from posterior_fusion.artifact.reader import load_global
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion.mode_laplace import evidence_prior_precision
from posterior_fusion.metrics import classification_metrics


def with_prior(g, delta: float):
    """The global artifact with the Laplace approximation's prior precision replaced by ``delta``."""
    return dataclasses.replace(g, metadata={**g.metadata, "laplace": {**g.metadata["laplace"], "prior_precision": delta}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--global", dest="glob", required=True, help="fedbens global artifact with a Laplace posterior")
    ap.add_argument("--data", required=True, help="labelled test file")
    ap.add_argument("--json", required=True, help="output rows")
    ap.add_argument("--scopes", choices=("all", "mixture"), default="all",
                    help="the mixture and each mode (default all), or the mixture alone (a ResNet's glm rows cost "
                         "~60 forward passes per image and mode)")
    ap.add_argument("--predictives", default="glm",
                    help="comma-separated uncertain predictives beside map, each at the server's and the evidence's "
                         "prior precision: glm, glm-last-layer (default glm)")
    args = ap.parse_args()
    uncertain = [p for p in args.predictives.split(",") if p]
    g = load_global(args.glob)
    x, y = read_silo(args.data, num_classes=g.model_spec.num_classes).tensors()
    lam0 = float(g.metadata["laplace"].get("server_prior_precision", g.metadata["laplace"]["prior_precision"]))
    scopes = [("mixture", g)]
    for k in range(len(g.members) if args.scopes == "all" else 0):
        one = dataclasses.replace(g, members=(g.members[k],), curvatures=(g.curvatures[k],),
                                  metadata={**g.metadata, "mode_weights": None})
        scopes.append((f"mode {k}", one))
    rows = []
    for scope, h in scopes:
        delta, _ = evidence_prior_precision(list(h.members), list(h.curvatures))
        variants = [("map", "-", None)] + [(p, prior, lam) for p in uncertain
                                           for prior, lam in (("server", lam0), ("evidence", delta))]
        for predictive, prior, lam in variants:
            hh = h if lam is None else with_prior(h, lam)
            p = hh.predict(x, predictive, raw=True)
            m = classification_metrics(p, y, 15)
            rows.append({"scope": scope, "predictive": predictive, "prior": prior, "prior_precision": lam,
                         "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"],
                         "confidence": p.max(1).values.mean().item()})
            print(json.dumps(rows[-1]), flush=True)
    with open(args.json, "w") as f:
        json.dump({"global": args.glob, "data": args.data, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
