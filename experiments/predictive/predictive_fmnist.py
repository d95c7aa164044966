"""Bayesian predictives on real Fashion-MNIST client artifacts.

    .venv/bin/python experiments/predictive/predictive_fmnist.py --clients 'runs/x/clients/<key>/post_*.h5' \
        --partition runs/x/partitions/<key> --out runs/predictive [--samples 30]

Fuses the same client artifacts with fedbens (Laplace at each mode, equal and Laplace-evidence
mode weights), the plain ensemble of all client components and FedBE; evaluates on the test
split with the map / mc / glm predictives, and the OOD AUROC on scikit-learn's handwritten
digits (1,797 real 8x8 images, bilinearly resized to 28x28, a different data set). Writes
results.json and results.md in --out.
"""

from __future__ import annotations

import argparse
import glob
import json
import time
from pathlib import Path

import posterior_fusion
from posterior_fusion.data.silo import read_silo
from posterior_fusion.experiment.measure import digits_ood
from posterior_fusion.fusion import FusionOptions, fuse, write_fused
from posterior_fusion.metrics import choose_scale, evaluate_posterior


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", required=True)
    ap.add_argument("--partition", required=True, help="folder with test.h5 and server_val.h5")
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--methods", default="fedbens,fedbens-laplace-weights,ensemble,fedbe")
    ap.add_argument("--predictives", default="map,mc,glm", help="which predictives to evaluate (glm is the slow one)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = sorted(glob.glob(args.clients))
    part = Path(args.partition)
    test, ood = read_silo(part / "test.h5"), digits_ood(out / "digits_ood.h5")
    val = read_silo(part / "server_val.h5")
    runs = {"fedbens": ("fedbens", {"mode_weights": "equal"}), "fedbens-laplace-weights": ("fedbens", {"mode_weights": "laplace"}),
            "ensemble": ("ensemble", {}), "fedbe": ("fedbe", {})}
    runs = {k: v for k, v in runs.items() if k in args.methods.split(",")}
    rows = []
    for name, (method, settings) in runs.items():
        t0 = time.perf_counter()
        inputs, res, meta = fuse(paths, method, FusionOptions(progress=False), settings, val_path=part / "server_val.h5")
        write_fused(out / f"{name}.h5", inputs, res, meta)
        g = posterior_fusion.load(out / f"{name}.h5")
        print(f"{name}: fused in {time.perf_counter() - t0:.0f}s", flush=True)
        variants = [("map", 1.0)]
        if g.has_posterior:  # mc at the posterior's own scale and tuned; glm tuned (its Jacobians are the cost)
            mc_scale = choose_scale(g, val, "mc", args.samples)[0] if "mc" in args.predictives else 1.0
            glm_scale = choose_scale(g, val, "glm", args.samples)[0] if "glm" in args.predictives else 1.0
            variants += [("mc", 1.0)] * (name == "fedbens") + [("mc", mc_scale), ("glm", glm_scale)]
        variants = [v for v in variants if v[0] in args.predictives.split(",")]
        for predictive, scale in variants:
            t0 = time.perf_counter()
            m = evaluate_posterior(g, test, predictive, args.samples, scale, ood=ood)
            row = {"method": name, "predictive": predictive, "scale": scale, "members": len(g.members),
                   "serving_params": len(g.members) * g.layout.dim * (args.samples if predictive == "mc" else 1),
                   **{k: m[k] for k in ("accuracy", "nll", "ece", "mce", "brier", "auroc_correct", "ood_auroc")},
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    previous = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else []
    done = {(r["method"], r["predictive"], r["scale"]) for r in rows}
    rows = [r for r in previous if (r["method"], r["predictive"], r["scale"]) not in done] + rows
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    lines = ["| method | predictive | scale | members | accuracy % | NLL | ECE | MCE | AUROC(correct) | OOD AUROC (digits) | eval s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['predictive']} | {r['scale']:g} | {r['members']} | {100 * r['accuracy']:.2f} | {r['nll']:.3f} | "
                     f"{r['ece']:.3f} | {r['mce']:.3f} | {r['auroc_correct']:.3f} | {r['ood_auroc']:.3f} | {r['seconds']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
