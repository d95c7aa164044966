"""The whole flow on scikit-learn's real data sets: digits (1,797 8x8 images; an MLP, and a transformer from
stock PyTorch layers reading the rows as tokens) and breast cancer (569 tabular rows, 30 features):
import -> partition (5 clients, α = 0.1 and 0.5) -> fit-local (kron, diag, diag+full) -> fuse (every method,
and the label-shift pool) -> evaluate, over 3 partition seeds.

    .venv/bin/python experiments/own_data/own_data.py --out runs/own_data [--seeds 0,1,2] [--epochs 20]
    .venv/bin/python experiments/own_data/own_data.py --out runs/own_data_transformer --datasets digits_transformer \
        --structures kron --components 3
    .venv/bin/python experiments/own_data/own_data.py --out runs/own_data_transformer_adamw \
        --datasets digits_transformer --structures kron --components 3 --optimizer adamw --lr 0.001 --schedule cosine \
        --grad-clip 1.0

Writes runs.csv and results.md (accuracy / NLL / ECE, mean ± std over seeds; the capture's time per training
epoch and the artifact's size) into --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import posterior_fusion
from posterior_fusion.data.prepare import import_data, partition_to_files
from posterior_fusion.data.silo import read_silo
from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion import METHODS, FusionOptions, applicable_settings, fuse
from posterior_fusion.local.fit import Start, fit_local
from posterior_fusion.local.fit_config import FitConfig, TrainConfig
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.models import ModelSpec

DATASETS = {
    "digits": {"source": "sklearn:digits", "model": ModelSpec("mlp", {"in_features": 64, "hidden": 32}), "test": 400},
    "breast_cancer": {"source": "sklearn:breast_cancer",
                      "model": ModelSpec("mlp", {"in_features": 30, "hidden": 16, "num_classes": 2}), "test": 120},
    # a transformer from stock PyTorch layers (nn.TransformerEncoderLayer: its attention on the fast path) on the
    # digits read row by row: 8 tokens of 8 values
    "digits_transformer": {"source": "sklearn:digits", "test": 400,
                           "model": ModelSpec("transformer", {"row_size": 8, "width": 32, "layers": 2, "heads": 4})},
}
POOL = "label-shift pool"  # the client ensemble's members pooled under label shift (ensemble pooling=label-shift)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--components", type=int, default=5)
    ap.add_argument("--datasets", default="digits,breast_cancer", help=f"comma-separated, of {', '.join(DATASETS)}")
    ap.add_argument("--structures", default="kron,diag,diag+full")
    ap.add_argument("--optimizer", default="sgd", help="fit-local's optimizer (sgd, adam, adamw)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--schedule", default="constant", help="constant or cosine")
    ap.add_argument("--grad-clip", type=float, default=None)
    args = ap.parse_args()
    out = Path(args.out)
    rows = []
    t_start = time.time()
    for name, cfg in ((n, DATASETS[n]) for n in args.datasets.split(",")):
        src = out / name / "all.h5"
        import_data(cfg["source"], src)
        for alpha in (0.1, 0.5):
            for seed in map(int, args.seeds.split(",")):
                part = out / name / f"a{alpha}_s{seed}"
                summary = partition_to_files(part, clients=5, alpha=alpha, partition_seed=seed, val_size=60,
                                             min_size=10, source=src, test_size=cfg["test"])
                test = read_silo(summary["test"])
                for structure in args.structures.split(","):
                    fit = FitConfig(structure=structure, train_seed=seed,
                                    train=TrainConfig(epochs=args.epochs, batch_size=32, optimizer=args.optimizer,
                                                      lr=args.lr, schedule=args.schedule, grad_clip=args.grad_clip))
                    paths = []
                    for i, c in enumerate(summary["clients"]):
                        paths.append(part / f"{structure}_post_{i}.h5")
                        if not paths[-1].exists():
                            fit_local(cfg["model"], c["path"], Start(seed, args.components), fit, paths[-1],
                                      log=lambda m: None)
                    comps = [c for p in paths for c in posterior_fusion.load(p).components]
                    per_epoch = sum(c.training["curvature_seconds"] for c in comps) / sum(
                        c.training["train_seconds"] / c.training["epochs"] for c in comps)
                    mib = sum(p.stat().st_size for p in paths) / len(paths) / 2**20
                    for method in [*METHODS, POOL]:
                        named, settings = ("ensemble", {"pooling": "label-shift"}) if method == POOL else (method, {})
                        try:
                            _, res, meta = fuse(paths, named, FusionOptions(sampling_seed=seed, progress=False),
                                                applicable_settings(named, settings), val_path=summary["server_val"])
                        except MethodNotApplicableError:
                            continue
                        m = evaluate_members(cfg["model"], res.members, test, weights=res.mode_weights,
                                             pooling=res.pooling(cfg["model"].num_classes))
                        row = {"dataset": name, "alpha": alpha, "seed": seed, "structure": structure, "method": method,
                               "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "members": len(res.members),
                               "optimizer": args.optimizer, "capture_per_epoch": round(per_epoch, 3),
                               "artifact_mib": round(mib, 3)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["structure"], r["method"], r["alpha"]), []).append(r)

    def ms(vals):
        mean = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        return mean, sd

    lines = [f"# scikit-learn real data sets: test accuracy % / NLL / ECE (mean ± std over seeds {args.seeds})", "",
             f"`.venv/bin/python experiments/own_data/own_data.py --out {args.out} --seeds {args.seeds} --epochs {args.epochs} "
             f"--optimizer {args.optimizer} --lr {args.lr} --schedule {args.schedule}"
             f"{f' --grad-clip {args.grad_clip}' if args.grad_clip else ''}` ({time.time() - t_start:.0f} s); capture ÷ "
             f"epoch {sum(r['capture_per_epoch'] for r in rows) / len(rows):.2f}, artifact "
             f"{sum(r['artifact_mib'] for r in rows) / len(rows):.2f} MiB per client (means over the cells)", "",
             "| data set | structure | method | α=0.1 accuracy | α=0.1 NLL | α=0.1 ECE | α=0.5 accuracy | α=0.5 NLL | α=0.5 ECE |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({k[:3] for k in groups}, key=lambda k: (k[0], k[1], [*METHODS, POOL].index(k[2])))
    for ds, st, me in keys:
        cells = []
        for a in (0.1, 0.5):
            rs = groups.get((ds, st, me, a), [])
            if not rs:
                cells += ["–"] * 3
                continue
            acc, acc_sd = ms([100 * r["accuracy"] for r in rs])
            nll, _ = ms([r["nll"] for r in rs])
            ece, _ = ms([r["ece"] for r in rs])
            cells += [f"{acc:.1f} ± {acc_sd:.1f}", f"{nll:.3f}", f"{ece:.3f}"]
        lines.append(f"| {ds} | {st} | {me} | " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
