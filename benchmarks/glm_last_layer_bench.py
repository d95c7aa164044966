"""The last-layer GLM predictive against the full-network GLM predictive, side by
side on one fedbens artifact: seconds, peak resident memory (a fresh ``pfuse evaluate`` process per
predictive) and the metrics.

    nice -n 19 .venv/bin/python benchmarks/glm_last_layer_bench.py --work runs/glmll \
        --json docs/results/predictive/glm_last_layer.json
    .venv/bin/python benchmarks/glm_last_layer_bench.py --api kron glm-last-layer   # one API case per process

Three clients (α = 0.5, M = 2, 5 epochs; LeNet with kron unless ``--model``/``--structure`` say otherwise) on 9,000 Fashion-MNIST training images (the
installed full set); fedbens with its Laplace posterior (100 steps); the full 10,000-image test set.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from posterior_fusion.experiment.measure import run_measured, save_rows

CLI = [sys.executable, "-c", "from posterior_fusion.cli.main import main; main()"]


def run(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{args[0]}: {proc.stderr.strip().splitlines()[-1]}")
    return proc


def api_case(structure: str, which: str) -> dict:
    """One predictive on a 26-class MLP (16 → 128 → 64 → 26, 12,122 weights) with a random precision of
    ``structure`` (kron: Kron per weight, Dense per bias; diag+full: diagonal, dense over the last layer)
    on 4,000 random inputs, through the Python API in this process: seconds and peak resident MiB."""
    import resource
    import time

    import torch

    from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron
    from posterior_fusion.layout import ParameterLayout
    from posterior_fusion.models import ModelSpec
    from posterior_fusion.predictive import last_layer_moments, logit_moments

    torch.manual_seed(0)
    spec = ModelSpec("mlp", {"in_features": 16, "hidden_sizes": [128, 64], "num_classes": 26})
    layout = ParameterLayout.from_model(spec.build())

    def psd(n: int) -> torch.Tensor:
        X = torch.randn(n, n + 2)
        return X @ X.T / n

    if structure == "kron":
        blocks = [Kron(psd(e.shape[0]), psd(e.size // e.shape[0])) if e.matrix_shape else Dense(psd(e.size))
                  for e in layout.entries]
    else:
        last = layout.entries[-2].offset
        blocks = [Diag(torch.rand(last) + 0.1), Dense(psd(layout.dim - last))]
    precision = BlockDiag(blocks).precision(0.1, 10.0)
    w, x = torch.randn(layout.dim) * 0.1, torch.randn(4000, 16)
    t0 = time.perf_counter()
    (last_layer_moments if which == "glm-last-layer" else logit_moments)(spec, w, precision, x)
    return {"model": "mlp 16-128-64-26", "structure": structure, "predictive": which,
            "seconds": round(time.perf_counter() - t0, 2),
            "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", nargs=2, metavar=("STRUCTURE", "PREDICTIVE"), default=None,
                    help="instead: one predictive (glm or glm-last-layer) on a 26-class MLP with a random STRUCTURE "
                         "(kron or diag+full) precision, in this process (run each in its own process)")
    ap.add_argument("--work", default="runs/glmll")
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--model-kwargs", default="{}")
    ap.add_argument("--structure", default="kron", help="the clients' curvature (kron, diag, diag+full)")
    args = ap.parse_args()
    if args.api:
        row = api_case(*args.api)
        print(json.dumps(row))
        save_rows(args.json, [row])
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "g.h5").exists():
        run("partition", "--clients", 3, "--alpha", 0.5, "--partition-seed", 0, "--max-train", 9000, "--out-dir", work)
        for c in range(3):
            run("fit-local", "--data", work / f"client_{c}.h5", "-M", 2, "--epochs", 5, "--train-seed", c,
                "--model", args.model, "--model-kwargs", args.model_kwargs, "--structure", args.structure,
                "--out", work / f"post_{c}.h5")
        run("fuse", *(work / f"post_{c}.h5" for c in range(3)), "--method", "fedbens", "--set", "steps=100", "--set", "solver=adam",
            "--out", work / "g.h5")
    rows = []
    for predictive in ("glm-last-layer", "glm"):
        r = run_measured("evaluate", work / "g.h5", "--data", work / "test.h5", "--predictive", predictive, "--json")
        if r["exit"]:
            raise SystemExit(r["error"])
        m = json.loads(r["stdout"])
        rows.append({"model": args.model, "model_kwargs": args.model_kwargs, "structure": args.structure,
                     "predictive": predictive, "seconds": r["seconds"], "peak_mib": r["peak_mib"],
                     "n": m["n"], "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"]})
        print(json.dumps(rows[-1]), flush=True)
    save_rows(args.json, rows)


if __name__ == "__main__":
    main()
