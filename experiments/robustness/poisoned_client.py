"""What a poisoned client does to FedBEns, with and without ``--robust`` screening.

    .venv/bin/python experiments/robustness/poisoned_client.py --out runs/poison [--epochs 5] [--components 3]

On the embedded Fashion-MNIST subset (the demo's data: 5 clients, alpha=0.1, LeNet, kron):
fits the clients, then replaces client 0's artifact by (a) its curvature scaled by 1e6 and
(b) its MAPs replaced by random weights with large curvature, and reports test accuracy of
fedbens on clean, poisoned, and poisoned + --robust inputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron
from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR
from posterior_fusion.data.prepare import partition_to_files
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.fit import fit_components
from posterior_fusion.local.fit_config import FitConfig, TrainConfig
from posterior_fusion.local.init import initial_weights
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component


def scaled(block, s):
    if isinstance(block, Kron):
        return Kron(block.B * s, block.A)
    if isinstance(block, Dense):
        return Dense(block.G * s)
    return Diag(block.g * s)


def poison(src: Path, dst: Path, curvature_scale: float, random_maps: bool, seed: int = 0) -> Path:
    art = posterior_fusion.load(src)
    g = torch.Generator().manual_seed(seed)
    comps = []
    for c in art.components:
        w = 0.3 * torch.randn(c.map.shape, generator=g) if random_maps else c.map
        comps.append(Component(c.index, w, BlockDiag([scaled(b, curvature_scale) for b in c.curvature.blocks]),
                               dict(c.training), c.temperature, c.prior_precision))
    write_client_artifact(dst, art.model_spec, art.layout, dict(art.metadata), comps)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--components", type=int, default=3)
    args = ap.parse_args()
    out = Path(args.out)
    summary = partition_to_files(out / "data", clients=5, alpha=0.1, partition_seed=0, data_dir=EMBEDDED_FMNIST_DIR)
    spec = ModelSpec("lenet", {})
    layout = ParameterLayout.from_model(spec.build())
    inits = initial_weights(spec, args.components, 0)
    cfg = FitConfig(structure="kron", train=TrainConfig(epochs=args.epochs))
    paths = []
    for i, c in enumerate(summary["clients"]):
        paths.append(out / f"post_{i}.h5")
        if not paths[-1].exists():
            meta, comps = fit_components(spec, read_silo(c["path"]), inits, cfg, log=lambda *_: None)
            write_client_artifact(paths[-1], spec, layout, meta, comps)
    test = read_silo(summary["test"])
    attacks = {
        "clean": paths,
        "curvature x1e6": [poison(paths[0], out / "poison_scale.h5", 1e6, False), *paths[1:]],
        "random MAPs, curvature x1e3": [poison(paths[0], out / "poison_random.h5", 1e3, True), *paths[1:]],
    }
    rows = []
    for name, inputs in attacks.items():
        for robust in (False, True):
            _, res, meta = fuse(inputs, "fedbens", FusionOptions(progress=False), val_path=summary["server_val"],
                                robust=robust)
            acc = evaluate_members(spec, res.members, test)["accuracy"]
            excluded = [Path(r["file"]).name for r in (meta["screening"] or []) if r["excluded"]]
            rows.append({"inputs": name, "robust": robust, "accuracy": acc, "excluded": excluded})
            print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
