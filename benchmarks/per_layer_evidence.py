"""The whole-network GLM predictive with a prior precision per block, each block's δ_b maximising the
modes' Laplace evidence over that block's parameters alone (MacKay's empirical Bayes per layer, the
evidence being a sum over blocks of a block-diagonal precision), against one δ for the whole network
(fedbens ``laplace_prior=evidence``) and the map predictive (issue 29, item 4: does a per-layer prior
stop ResNet-20's whole-network GLM from collapsing?).

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/per_layer_evidence.py --global runs/calib_a04/paper.h5 \\
        --data runs/calib_a04/test.h5 --n 1000 --json docs/results/fusion_safety/evidence/per_layer_evidence_resnet20_a0.4.json

Rows: accuracy, NLL, ECE (15 bins), mean confidence and seconds per variant; the per-block δ's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from measured import save_rows

from posterior_fusion import predictive as P
from posterior_fusion.artifact.reader import load_global
from posterior_fusion.curvature import BlockDiag
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion.mode_laplace import evidence_prior_precision
from posterior_fusion.metrics import classification_metrics


def per_block_deltas(members: list[torch.Tensor], curvatures: list[BlockDiag]) -> list[float]:
    """δ_b per block position: the evidence maximiser over the K modes restricted to block b."""
    ref = curvatures[0]
    out = []
    for j, (off, block) in enumerate(zip(ref.offsets, ref.blocks)):
        sub = [BlockDiag([c.blocks[j]]) for c in curvatures]
        out.append(evidence_prior_precision([w[off: off + block.dim] for w in members], sub)[0])
    return out


def with_block_shifts(curvature: BlockDiag, deltas: list[float]) -> BlockDiag:
    """``G + blockdiag(δ_b I)``: the precision with one prior precision per block (BlockDiag pushes one
    shift into every block, so the blocks are replaced after construction)."""
    prec = curvature.precision(1.0, min(deltas))
    prec.blocks = tuple(b.with_scale_shift(1.0, d) for b, d in zip(curvature.blocks, deltas))
    return prec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--global", dest="glob", required=True, help="fedbens global artifact with a Laplace posterior")
    ap.add_argument("--data", required=True, help="labelled test file")
    ap.add_argument("--n", type=int, default=1000, help="test images (default 1000)")
    ap.add_argument("--json", default=None, help="output rows (default: none)")
    args = ap.parse_args()
    g = load_global(args.glob)
    x, y = read_silo(args.data, num_classes=g.model_spec.num_classes).tensors()
    x, y = x[: args.n], y[: args.n]
    members, curvatures = list(g.members), list(g.curvatures)
    delta, _ = evidence_prior_precision(members, curvatures)
    deltas = per_block_deltas(members, curvatures)
    print(json.dumps({"delta": delta, "per_block": [round(d, 3) for d in deltas]}), flush=True)
    weights = torch.tensor(g.metadata["mode_weights"]) if g.metadata.get("mode_weights") else None
    variants = [("map", None), ("glm, one δ (evidence)", [c.precision(1.0, delta) for c in curvatures]),
                ("glm, δ per block (evidence)", [with_block_shifts(c, deltas) for c in curvatures])]
    rows = []
    for name, precisions in variants:
        t0 = time.time()
        p = P.predict(g.model_spec, members, x, "map" if precisions is None else "glm", precisions=precisions,
                      weights=weights)
        m = classification_metrics(p, y, 15)
        rows.append({"variant": name, "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"],
                     "confidence": p.max(1).values.mean().item(), "seconds": round(time.time() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    save_rows(args.json, {"global": args.glob, "n": args.n, "delta": delta, "per_block_deltas": deltas, "rows": rows})


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
