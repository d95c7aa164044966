"""Differentially private artifacts against non-private ones (README.md): the same five silos fitted with
``fit-local --dp --dp-epsilon E`` for each ε, fused by fedbens, FedAvg, Fisher merge and the label-shift pool,
evaluated on the test images, with the loss-threshold membership attack (``pfuse audit``) against every
silo's artifact beside each row. One JSON file of rows per (α, seed); ``--report`` prints the table.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/dp/run.py --alphas 0.1,0.4 --seeds 0 \\
        --work runs/dp --json-dir docs/results/dp
    .venv/bin/python experiments/dp/run.py --report docs/results/dp
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from posterior_fusion.artifact.reader import load_client
from posterior_fusion.data.prepare import partition_to_files
from posterior_fusion.data.silo import SiloData, read_silo, write_silo
from posterior_fusion.fusion import FusionOptions, fuse, get_method
from posterior_fusion.local.audit import membership
from posterior_fusion.local.fit import Start, fit_local
from posterior_fusion.local.fit_config import fit_config_from
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.models import ModelSpec

FUSIONS = [("fedbens (default)", "fedbens", {}), ("fedavg", "fedavg", {}), ("fisher-merge", "fisher-merge", {}),
           ("label-shift pool", "ensemble", {"pooling": "label-shift"}), ("fedlpa", "fedlpa", {})]  # fedlpa: kron only


def run_cell(args, alpha: float, seed: int) -> list[dict]:
    work = Path(args.work) / (f"a{alpha}_s{seed}" + ("" if args.max_train == 12000 else f"_n{args.max_train}"))
    if not (work / "data" / "client_0.h5").exists():
        partition_to_files(work / "data", clients=5, alpha=alpha, partition_seed=seed, val_size=0,
                           max_train=args.max_train)
    test = read_silo(work / "data" / "test.h5")
    holdout = SiloData(test.x[-500:], test.y[-500:], test.dataset, test.num_classes, transform=test.transform)
    write_silo(work / "holdout.h5", holdout)
    test = SiloData(test.x[:-500], test.y[:-500], test.dataset, test.num_classes, transform=test.transform)
    spec = ModelSpec("lenet", {})
    rows = []
    for eps in [float(e) for e in args.epsilons.split(",")]:
        private = math.isfinite(eps)
        settings = {"structure": args.structure, "epochs": args.epochs, "train_seed": seed, "lr": args.lr,
                    "batch_size": args.batch_size, **({"dp": True, "dp_epsilon": eps} if private else {})}
        paths, aucs = [], []
        for c in range(5):
            out = work / f"eps{eps:g}_lr{args.lr:g}_b{args.batch_size}{recipe_tag(args.epochs, args.structure, args.max_train)}" / f"post_{c}.h5"
            out.parent.mkdir(parents=True, exist_ok=True)
            if not out.exists():
                fit_local(spec, work / "data" / f"client_{c}.h5", Start(seed, 1),
                          fit_config_from(dict(settings, train_seed=100 * seed + c)), out, log=lambda m: None)
            paths.append(out)
            aucs.append(membership(load_client(out), read_silo(work / "data" / f"client_{c}.h5"), holdout)["auc"])
        guarantee = load_client(paths[0]).metadata.get("dp", {})
        for label, method, settings_ in FUSIONS:
            if not get_method(method).applies_to(args.structure):
                continue
            t0 = time.time()
            _, res, _ = fuse([str(p) for p in paths], method, FusionOptions(progress=False), settings_)
            m = evaluate_members(spec, res.members, test, weights=res.mode_weights, pooling=res.pooling(10))
            rows.append({"row": label, "target_epsilon": eps, "epsilon": guarantee.get("epsilon", math.inf),
                         "delta": guarantee.get("delta"), "accuracy": 100 * m["accuracy"], "nll": m["nll"],
                         "ece": m["ece"], "attack_auc_mean": statistics.mean(aucs), "attack_auc_max": max(aucs),
                         "alpha": alpha, "seed": seed, "epochs": args.epochs, "max_train": args.max_train,
                         "lr": args.lr, "batch_size": args.batch_size, "structure": args.structure,
                         "server_seconds": round(time.time() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def recipe_tag(epochs: int, structure: str = "diag", max_train: int = 12000) -> str:
    """The file-name tag of a recipe's epochs, structure and training images (none for the default 5 epochs, diag
    and 12,000 images, whose files came first)."""
    return (("" if epochs == 5 else f"_e{epochs}") + ("" if structure == "diag" else f"_{structure}")
            + ("" if max_train == 12000 else f"_n{max_train}"))


def report(folder: Path) -> None:
    rows = [r for p in sorted(folder.glob("*.json")) for r in json.loads(p.read_text())]
    alphas = sorted({r["alpha"] for r in rows})
    print("| method | ε (target) | " + " | ".join(f"α = {a}: accuracy · NLL / ECE" for a in alphas)
          + " | attack AUC (mean, max over silos) |")
    print("|---|---|" + "---|" * len(alphas) + "---|")
    def recipe(r: dict) -> tuple:
        return (r.get("max_train", 12000), r.get("lr", 0.01), r.get("batch_size", 64), r.get("epochs", 5),
                r.get("structure", "diag"))

    recipes = sorted({recipe(r) for r in rows})
    for (n, lr, batch, epochs, structure), (label, _, _) in ((rec, f) for rec in recipes for f in FUSIONS):
        for eps in sorted({r["target_epsilon"] for r in rows}):
            cells, auc = [], []
            for a in alphas:
                rs = [r for r in rows if (r["row"], r["target_epsilon"], r["alpha"], *recipe(r))
                      == (label, eps, a, n, lr, batch, epochs, structure)]
                if not rs:
                    cells.append("—")
                    continue
                acc = [r["accuracy"] for r in rs]
                cells.append(f"{statistics.mean(acc):.2f}" + (f" ± {statistics.stdev(acc):.2f}" if len(acc) > 1 else "")
                             + f" · {statistics.mean(r['nll'] for r in rs):.3f} / {statistics.mean(r['ece'] for r in rs):.3f}"
                             + f" ({len(rs)})")
                auc += [(r["attack_auc_mean"], r["attack_auc_max"]) for r in rs]
            if not auc:  # this recipe never ran at this ε
                continue
            shown = "∞ (no privacy)" if math.isinf(eps) else f"{eps:g}"
            attack = f"{statistics.mean(a for a, _ in auc):.3f}, {max(m for _, m in auc):.3f}" if auc else "—"
            images = "" if n == 12000 else f", {n:,} images"
            print(f"| {label} ({structure}, lr {lr:g}, batch {batch}, {epochs} epochs{images}) | {shown} | " + " | ".join(cells)
                  + f" | {attack} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alphas", default="0.1,0.4")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--epsilons", default="1,3,8,inf")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate of every fit (fit-local's default)")
    ap.add_argument("--batch-size", type=int, default=64, help="SGD batch size of every fit (fit-local's default)")
    ap.add_argument("--max-train", type=int, default=12000, help="training images split among the five silos")
    ap.add_argument("--structure", default="diag", choices=("diag", "kron"), help="the artifacts' curvature")
    ap.add_argument("--work", default="runs/dp")
    ap.add_argument("--json-dir", default="docs/results/dp")
    ap.add_argument("--report", default=None)
    args = ap.parse_args()
    if args.report:
        report(Path(args.report))
        return
    Path(args.json_dir).mkdir(parents=True, exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for alpha in [float(a) for a in args.alphas.split(",")]:
            out = Path(args.json_dir) / (f"lenet_a{alpha}_s{seed}_lr{args.lr:g}_b{args.batch_size}"
                                         f"{recipe_tag(args.epochs, args.structure, args.max_train)}.json")
            if not out.exists():
                out.write_text(json.dumps(run_cell(args, alpha, seed), indent=1))


if __name__ == "__main__":
    main()
