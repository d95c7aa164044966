"""Why our fisher-merge differs from the paper's: the same client MAPs merged with four diagonal
weightings, evaluated on the cell's test split.

    .venv/bin/python experiments/table1/fisher_merge_variants.py runs/table2_reference

For every cell of a finished grid (its partitions and the cached client artifacts of its kron and
diag+full/diag fits; component 0, as the grid's fisher-merge) it prints the test accuracy of
Σ_c F_c ŵ_c / Σ_c F_c with

* ``kron-sum``: F_c the diagonal of the client's K-FAC GGN, summed over its data (the grid's kron row);
* ``exact-sum``: F_c the exact diagonal GGN (= Fisher for cross-entropy) summed over the data (the
  grid's diag+full / diag row);
* ``exact-mean``: the exact diagonal divided by the client's n — the per-example Fisher of Matena &
  Raffel and of the FedBEns authors' baseline code (nngeometry's ``FIM`` averages over examples), so
  every client counts alike whatever its size;
* ``exact-mean-floor``: as ``exact-mean`` with the authors' fallback: FedAvg wherever Σ_c F_c < 1e-6
  (an absolute threshold on averaged Fishers), instead of ours (relative, 1e-12 of the largest);
* ``fedavg``: the n-weighted average, for scale.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

import posterior_fusion
from posterior_fusion.data.silo import read_silo
from posterior_fusion.metrics import evaluate_members

VARIANTS = ("kron-sum", "exact-sum", "exact-mean", "exact-mean-floor", "fedavg")


def merge(maps: torch.Tensor, F: torch.Tensor, n: torch.Tensor, floor: float | None) -> torch.Tensor:
    """``maps``/``F`` ``(C, d)``, ``n`` ``(C,)``: Fisher-weighted average, FedAvg where Σ F is tiny."""
    avg = (n[:, None] * maps).sum(0) / n.sum()
    den = F.sum(0)
    tiny = den < floor if floor is not None else den <= 1e-12 * den.max()
    return torch.where(tiny, avg, (F * maps).sum(0) / den.clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a grid's --out-dir (its partitions/ and clients/ caches)")
    args = ap.parse_args()
    run = Path(args.run_dir)
    partitions = {}
    for summary in glob.glob(str(run / "partitions" / "*" / "summary.json")):
        s = json.loads(Path(summary).read_text())
        partitions[tuple(c["n"] for c in s["clients"])] = (s["alpha"], Path(summary).parent / "test.h5")
    fits: dict[tuple, dict[str, list]] = defaultdict(dict)
    for cdir in sorted(glob.glob(str(run / "clients" / "*"))):
        files = sorted(glob.glob(f"{cdir}/post_*.h5"), key=lambda p: int(Path(p).stem.split("_")[1]))
        if not files:
            continue
        clients = [posterior_fusion.load(p) for p in files]
        sizes = tuple(c.n_data for c in clients)
        if sizes not in partitions:
            continue
        key = (*partitions[sizes], len(clients), clients[0].metadata.get("train_seed"))
        fits[key]["diag" if clients[0].structure in ("diag", "diag+full") else clients[0].structure] = clients
    rows: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (alpha, test_path, C, seed), by in sorted(fits.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3])):
        if "kron" not in by or "diag" not in by:
            continue
        test = read_silo(test_path)
        kron, diag = by["kron"], by["diag"]
        spec = kron[0].model_spec
        maps = torch.stack([c.components[0].map.float() for c in kron])
        if not torch.equal(maps, torch.stack([c.components[0].map.float() for c in diag])):
            raise SystemExit(f"{test_path}: the kron and diag fits of seed {seed} have different MAPs")
        n = torch.tensor([float(c.n_data) for c in kron])
        F_kron = torch.stack([c.components[0].curvature.diagonal().float() for c in kron])
        F_exact = torch.stack([c.components[0].curvature.diagonal().float() for c in diag])
        merged = {"kron-sum": merge(maps, F_kron, n, None), "exact-sum": merge(maps, F_exact, n, None),
                  "exact-mean": merge(maps, F_exact / n[:, None], n, None),
                  "exact-mean-floor": merge(maps, F_exact / n[:, None], n, 1e-6),
                  "fedavg": (n[:, None] * maps).sum(0) / n.sum()}
        accs = {k: 100 * evaluate_members(spec, [w], test)["accuracy"] for k, w in merged.items()}
        floored = int((F_exact / n[:, None]).sum(0).lt(1e-6).sum())
        print(f"alpha {alpha} C {C} seed {seed}: " + ", ".join(f"{k} {v:.2f}" for k, v in accs.items())
              + f" (authors' floor sends {floored} of {maps.shape[1]} weights to FedAvg)", flush=True)
        for k, v in accs.items():
            rows[(alpha, C)][k].append(v)
    print("\n| α | C | seeds | " + " | ".join(VARIANTS) + " |")
    print("|---|---|---|" + "---|" * len(VARIANTS))
    for (alpha, C), r in sorted(rows.items()):
        cells = []
        for k in VARIANTS:
            v = r[k]
            cells.append(f"{statistics.mean(v):.2f}" + (f" ± {statistics.stdev(v):.2f}" if len(v) > 1 else ""))
        print(f"| {alpha} | {C} | {len(r['fedavg'])} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
