"""Detection and false-exclusion rates of ``fuse --robust`` on real client artifacts.

    .venv/bin/python experiments/robustness/screening_rates.py --clients 'runs/x/clients/<key>/post_*.h5' \
        --val runs/x/partitions/<key>/server_val.h5 --out runs/screening

For every attack, every choice of the attacked client (a copy of client a, attacked) and
every set of honest clients of size C-1 (C = 3 and 5): is the attacker excluded, and is any
honest client excluded? Prints one JSON line per attack and C.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
from pathlib import Path

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron
from posterior_fusion.data.silo import read_silo
from posterior_fusion.errors import ScreeningError
from posterior_fusion.fusion.robust import screen_clients
from posterior_fusion.posterior import Component


def attacked(art, dst, scale=1.0, flip=False, meta=None):
    comps = []
    for c in art.components:
        blocks = [Kron(b.B * scale, b.A) if isinstance(b, Kron) else Dense(b.G * scale) if isinstance(b, Dense)
                  else Diag(b.g * scale) for b in c.curvature.blocks]
        comps.append(Component(c.index, -c.map if flip else c.map, BlockDiag(blocks), dict(c.training),
                               c.temperature, c.prior_precision))
    write_client_artifact(dst, art.model_spec, art.layout, dict(art.metadata, **(meta or {})), comps)
    return posterior_fusion.load(dst)


ATTACKS = {
    "curvature x10": lambda a, d: attacked(a, d, scale=10.0),
    "curvature x100": lambda a, d: attacked(a, d, scale=100.0),
    "T = 1e-4": lambda a, d: attacked(a, d, meta={"temperature": 1e-4}),
    "n_data x1e4": lambda a, d: attacked(a, d, meta={"n_data": a.n_data * 10**4,
                                                     "class_counts": [a.n_data * 10**4] + [0] * 9}),
    "sign flip": lambda a, d: attacked(a, d, flip=True),
    "duplicate": lambda a, d: attacked(a, d, meta={"note": "resubmitted"}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", required=True, help="glob of honest client artifacts")
    ap.add_argument("--val", default=None, help="server validation data (enables the validation check)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    honest = [posterior_fusion.load(p) for p in sorted(glob.glob(args.clients))]
    val = read_silo(args.val) if args.val else None
    kept_all = {C: all(len(screen_clients(list(s), val=val)[0]) == C for s in itertools.combinations(honest, C))
                for C in (3, 5) if C <= len(honest)}
    print(json.dumps({"attack": "none (honest only)", "all honest kept": kept_all}), flush=True)
    for name, make in ATTACKS.items():
        for C in (3, 5):
            trials = detected = false_excl = aborted = 0
            for a, src in enumerate(honest):
                for others in itertools.combinations([h for i, h in enumerate(honest) if i != a], C - 1):
                    if name == "duplicate":
                        others = (src, *others[1:])
                    bad = make(src, out / f"attack_{a}.h5")
                    trials += 1
                    try:
                        _, rows = screen_clients([*others, bad], val=val)
                    except ScreeningError:
                        aborted += 1
                        continue
                    detected += rows[-1]["excluded"]
                    false_excl += any(r["excluded"] for r in rows[:-1])
            print(json.dumps({"attack": name, "C": C, "trials": trials, "detected": detected,
                              "honest_excluded_trials": false_excl, "aborted": aborted}), flush=True)


if __name__ == "__main__":
    main()
