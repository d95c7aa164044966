"""BatchNorm trained from random starting points (README.md): five silos train a BatchNorm ResNet-20 from shared
random starts and fold their statistics into the affine parameters (``fit-local --batchnorm fold``); the server
fuses with every method, its BatchNorm statistics by both rules side by side (``fuse --batchnorm-statistics fold``
and ``reset`` on 1,000 unlabeled server images), beside the same network with GroupNorm and a centralised network
trained on the pooled silos. One JSON file of rows per (norm, α, seed); ``--report`` prints the table.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/batchnorm/run.py --alphas 0.1,0.4 --seeds 0,1,2 \\
        --work runs/batchnorm --json-dir docs/results/batchnorm
    .venv/bin/python experiments/batchnorm/run.py --report docs/results/batchnorm
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from posterior_fusion.artifact.reader import load_client
from posterior_fusion.data.prepare import partition_to_files
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.local.fit import fit_and_write
from posterior_fusion.local.fit_config import TrainConfig, fit_config_from
from posterior_fusion.local.init import initial_weights
from posterior_fusion.local.train import train_map
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.batchnorm import batch_norms, fold_statistics, thaw
from posterior_fusion.models.members import build_model

# (row label, method, settings): every fusion of one cell (kron curvature)
FUSIONS = [
    ("client ensemble", "ensemble", {}),
    ("label-shift pool", "ensemble", {"pooling": "label-shift"}),
    ("fedbens (default)", "fedbens", {}),
    ("fedbens, prior centre at the prior", "fedbens", {"prior_centre": "prior"}),
    ("fedlpa", "fedlpa", {}),
    ("fedfisher", "fedfisher", {}),
    ("fisher-merge", "fisher-merge", {}),
    ("regmean", "regmean", {}),
    ("hbfl", "hbfl", {}),
    ("fedavg", "fedavg", {}),
]


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def centralised(spec: ModelSpec, x: torch.Tensor, y: torch.Tensor, start: torch.Tensor, args, seed: int) -> torch.Tensor:
    """One network trained on the pooled silos from ``start`` with the silos' recipe (its BatchNorm statistics
    estimated on the pooled silos and folded in, as a silo does)."""
    model = build_model(spec, start)
    if batch_norms(model):
        thaw(model)
    torch.manual_seed(seed)
    train_map(model, x, y, TrainConfig(epochs=args.epochs, weight_decay=args.temperature / args.prior_var / len(y)),
              seed=seed, desc="centralised")
    if batch_norms(model):
        fold_statistics(model, x, 256)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def run_cell(args, norm: str, alpha: float, seed: int) -> list[dict]:
    work = Path(args.work) / f"a{alpha}_s{seed}"
    split = work / "data"
    if not (split / "client_0.h5").exists():
        partition_to_files(split, clients=args.clients, alpha=alpha, partition_seed=seed, val_size=0,
                           unlabeled_size=args.server_inputs, max_train=args.max_train)
    spec = ModelSpec("resnet20", {"in_channels": 1, "width": args.width, "norm": norm})
    inits = initial_weights(spec, args.components, seed)
    test = read_silo(args.test)
    paths = []
    for c in range(args.clients):
        out = work / norm / f"post_{c}.h5"
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.exists():
            cfg = fit_config_from({"structure": "kron", "kfac": "reduce", "ggn": "mc", "epochs": args.epochs,
                                   "temperature": args.temperature, "prior_var": args.prior_var,
                                   "train_seed": 100 * seed + c})
            fit_and_write(spec, read_silo(split / f"client_{c}.h5"), inits, cfg, out, {"init_seed": seed},
                          log=lambda m: None)
            log(f"{norm} α={alpha} seed {seed}: silo {c} fitted")
        paths.append(str(out))
    rules = ("fold", "reset") if norm == "batch" else ("fold",)
    rows = []
    for label, method, settings in FUSIONS:
        for rule in rules:
            t0 = time.time()
            _, res, _ = fuse(paths, method, FusionOptions(progress=False, batchnorm_statistics=rule), settings,
                             unlabeled_path=split / "server_unlabeled.h5" if rule == "reset" else None)
            m = evaluate_members(spec, res.members, test, weights=res.mode_weights,
                                 pooling=res.pooling(spec.num_classes))
            rows.append({"row": label, "norm": norm, "statistics": rule, "accuracy": 100 * m["accuracy"],
                         "nll": m["nll"], "ece": m["ece"], "server_seconds": round(time.time() - t0, 1)})
            log(f"{norm} α={alpha} seed {seed} {label} [{rule}]: {rows[-1]['accuracy']:.2f}")
    silos = [read_silo(split / f"client_{c}.h5").tensors() for c in range(args.clients)]
    x, y = torch.cat([s[0] for s in silos]), torch.cat([s[1] for s in silos])
    w = centralised(spec, x, y, inits[0], args, seed)
    m = evaluate_members(spec, [w], test)
    rows.append({"row": "centralised", "norm": norm, "statistics": "fold", "accuracy": 100 * m["accuracy"],
                 "nll": m["nll"], "ece": m["ece"]})
    log(f"{norm} α={alpha} seed {seed} centralised: {rows[-1]['accuracy']:.2f}")
    times = [(c.training["curvature_seconds"], c.training["train_seconds"] / c.training["epochs"])
             for p in paths for c in load_client(p).components]
    for r in rows:
        r["capture_per_epoch"] = round(statistics.mean(a for a, _ in times) / statistics.mean(b for _, b in times), 2)
    return rows


def report(folder: Path) -> None:
    """One table: a row per fusion, for each α the BatchNorm network's two statistics rules and the GroupNorm
    network's accuracy (mean ± sd over seeds, the number of seeds in brackets)."""
    cells: dict[tuple, list[float]] = {}
    alphas = set()
    for f in sorted(folder.glob("*.json")):
        obj = json.loads(f.read_text())
        alphas.add(obj["alpha"])
        for r in obj["rows"]:
            cells.setdefault((r["row"], r["norm"], r["statistics"], obj["alpha"]), []).append(r["accuracy"])
    columns = [("batch", "fold", "BatchNorm, fold"), ("batch", "reset", "BatchNorm, reset"), ("group", "fold", "GroupNorm")]

    def cell(v: list[float]) -> str:
        if not v:
            return "—"
        spread = f" ± {statistics.stdev(v):.2f}" if len(v) > 1 else ""
        return f"{statistics.mean(v):.2f}{spread} ({len(v)})"

    print("| | " + " | ".join(f"α = {a}: {name}" for a in sorted(alphas) for _, _, name in columns) + " |")
    print("|---|" + "---|" * (len(alphas) * len(columns)))
    for row in [label for label, _, _ in FUSIONS] + ["centralised"]:
        vals = [cell(cells.get((row, norm, rule, a), [])) for a in sorted(alphas) for norm, rule, _ in columns]
        print(f"| {row} | " + " | ".join(vals) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alphas", default="0.1,0.4")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--norms", default="batch,group")
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--components", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.1)
    p.add_argument("--prior-var", type=float, default=0.1)
    p.add_argument("--server-inputs", type=int, default=1000)
    p.add_argument("--max-train", type=int, default=None, help="cap on training images (a smoke run) [default: all]")
    p.add_argument("--test", default=None, help="test file [default: Fashion-MNIST's test images, written once]")
    p.add_argument("--work", default="runs/batchnorm")
    p.add_argument("--json-dir", default="docs/results/batchnorm")
    p.add_argument("--report", default=None, metavar="DIR")
    args = p.parse_args()
    if args.report:
        report(Path(args.report))
        return
    if args.test is None:
        from posterior_fusion.data.idx import load_fmnist
        from posterior_fusion.data.silo import SiloData, write_silo
        from posterior_fusion.data.transform import InputTransform

        args.test = str(Path(args.work) / "test.h5")
        if not Path(args.test).exists():
            Path(args.work).mkdir(parents=True, exist_ok=True)
            xt, yt = load_fmnist("test")
            write_silo(args.test, SiloData(xt, yt, "fmnist", 10, transform=InputTransform.constants("fmnist")))
    out = Path(args.json_dir)
    out.mkdir(parents=True, exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for alpha in [float(a) for a in args.alphas.split(",")]:
            for norm in args.norms.split(","):
                target = out / f"{norm}_a{alpha}_s{seed}.json"
                if target.exists():
                    continue
                rows = run_cell(args, norm, alpha, seed)
                target.write_text(json.dumps({"norm": norm, "alpha": alpha, "seed": seed, "width": args.width,
                                              "epochs": args.epochs, "components": args.components,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
