"""Ensemble selection (Caruana et al., ICML 2004) over the client members and the fused
modes, at most the client ensemble's serving cost.

    .venv/bin/python experiments/ensemble_gap/ensemble_selection.py --dir DIR --pool ens.h5 --pool anchor.h5 \
        --pool refit2_adam.h5 --json OUT.json

``DIR`` holds one ensemble_gap cell (``server_val.h5``, ``test.h5`` and the global artifacts named by
``--pool``). Every member of every pooled artifact predicts the server's validation split and the test
set once (its MAP); greedy forward selection *with replacement* then adds, one at a time, the member
whose addition gives the lowest validation NLL of the averaged probabilities, while the number of
*distinct* members stays within ``--max-members`` (the client ensemble's 25), for ``--rounds`` additions,
and keeps the prefix with the best validation NLL (Caruana's "best size"). Two rows per pool combination:
the plain average of every pooled member ("all"; a union serves more than the budget) and the selection;
test accuracy / NLL / ECE, the distinct members served and where they come from.
The validation split is the one fedbens' Adam already selects its iterate on (500 images).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from posterior_fusion.artifact.reader import load_global
from posterior_fusion.data.silo import read_silo
from posterior_fusion.metrics import classification_metrics, ensemble_probabilities


def member_probs(path: Path, x: torch.Tensor) -> torch.Tensor:
    """``(K, n, C)``: each member's MAP softmax on ``x``."""
    g = load_global(path)
    return ensemble_probabilities(g.model_spec, list(g.members), x)[1].double()


def nll(p: torch.Tensor, y: torch.Tensor) -> float:
    return -p[torch.arange(len(y)), y].clamp_min(1e-12).log().mean().item()


def select(val: torch.Tensor, y: torch.Tensor, max_members: int, rounds: int) -> list[int]:
    """Greedy forward selection with replacement: the multiset of member indices (the best prefix)."""
    chosen: list[int] = []
    total = torch.zeros_like(val[0])
    best, best_len = float("inf"), 0
    for _ in range(rounds):
        allowed = [k for k in range(len(val)) if k in chosen or len(set(chosen)) < max_members]
        scores = [nll((total + val[k]) / (len(chosen) + 1), y) for k in allowed]
        k = allowed[min(range(len(allowed)), key=scores.__getitem__)]
        chosen.append(k)
        total += val[k]
        score = min(scores)
        if score < best:
            best, best_len = score, len(chosen)
    return chosen[:best_len]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--pool", action="append", required=True, help="global artifact in DIR (repeatable)")
    ap.add_argument("--max-members", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    xv, yv = read_silo(args.dir / "server_val.h5", num_classes=10).tensors()
    xt, yt = read_silo(args.dir / "test.h5", num_classes=10).tensors()
    probs = {name: (member_probs(args.dir / name, xv), member_probs(args.dir / name, xt)) for name in args.pool}
    rows = []
    for r in range(1, len(args.pool) + 1):
        for combo in itertools.combinations(args.pool, r):
            val = torch.cat([probs[n][0] for n in combo])
            test = torch.cat([probs[n][1] for n in combo])
            origin = [n for n in combo for _ in range(len(probs[n][0]))]
            for how in ("all", "selected"):
                if how == "all":  # a union's plain average serves every member (over the budget: for reference)
                    idx = list(range(len(val)))
                else:
                    idx = select(val, yv, args.max_members, args.rounds)
                p = test[idx].mean(0)
                m = classification_metrics(p, yt, 15)
                distinct = sorted(set(idx))
                rows.append({"pool": list(combo), "how": how, "distinct_members": len(distinct),
                             "from": {n: sum(origin[k] == n for k in distinct) for n in combo},
                             "val_nll": nll(val[idx].mean(0), yv),
                             "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"]})
                print(json.dumps(rows[-1]), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"dir": str(args.dir), "max_members": args.max_members, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
