"""The server at real size: ``pfuse fuse --method fedbens`` on ResNet-20 artifacts of
width ``--width`` from C clients with M components each, in a fresh process per run (peak resident
memory from VmHWM, wall seconds).

    nice -n 19 .venv/bin/python benchmarks/server_size_bench.py --width 64 --clients 5 --components 5 \
        --json docs/results/real_size/server_w64_c5_m5.json

The C·M components share one real K-FAC-reduce capture (random CIFAR-shaped images, ``--n`` of them)
with per-component scales and MAP perturbations: the server's cost depends on the sizes, not on the
values. Three runs: ``steps=S1`` and ``steps=S2`` without the Laplace step (their difference over
S2 − S1 is the seconds per step, the rest the set-up) and ``steps=S1`` with it (its difference to
the first is the Laplace step at the modes). ``--whole K=V,…`` instead: one run of the whole fusion with
those fedbens settings, Laplace step included (e.g. ``solver=em``: exact per-layer solves, no Adam steps).
``--devices cpu,cuda``: the same runs with ``fuse --device`` each, side by side on the same artifacts; a
CUDA row adds the GPU peak (``torch.cuda.max_memory_allocated``) and ``fuse``'s own estimate of the GPU's
working set (``estimate_device_bytes``, what ``--max-memory`` checks against the free GPU memory).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.choices import COMPRESS_METRICS, VECTOR_DTYPES
from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.curvature.compressed import Compression
from posterior_fusion.experiment.measure import run_measured, save_rows
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import capture
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component, frozen_mapping


def fuse(paths: list[Path], out: Path, settings: list[str], max_memory: str, device: str = "cpu") -> dict:
    args = ["fuse", *map(str, paths), "--method", "fedbens", "--max-memory", max_memory, "--device", device,
            "--out", str(out)]
    for s in settings:
        args += ["--set", s]
    r = run_measured(*args)
    return {"settings": settings, **{k: r[k] for k in ("exit", "seconds", "peak_mib", "gpu_peak_mib", "error")}}


def device_estimate_mib(paths: list[Path], settings: list[str]) -> float:
    """``fuse``'s estimate of the GPU's working set for these artifacts and fedbens settings (MiB)."""
    from posterior_fusion.artifact.reader import declared_bytes
    from posterior_fusion.fusion.from_posteriors import method_settings
    from posterior_fusion.fusion.resources import estimate_device_bytes
    from posterior_fusion.fusion.settings_parsing import parse_pairs

    chosen = method_settings("fedbens", parse_pairs(settings))
    return round(estimate_device_bytes([declared_bytes(p) for p in paths], "fedbens", chosen) / 2**20, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--components", type=int, default=5)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--steps", default="10,30", help="S1,S2")
    ap.add_argument("--compress", type=float, default=0.0)
    ap.add_argument("--compress-metric", default="frobenius", choices=COMPRESS_METRICS)
    ap.add_argument("--compress-vectors", default="float32", choices=VECTOR_DTYPES)
    ap.add_argument("--max-memory", default="20G")
    ap.add_argument("--json", default=None)
    ap.add_argument("--whole", default=None, help="K=V,...: one whole fedbens run with these settings")
    ap.add_argument("--devices", default="cpu", help="comma-separated fuse --device values, run side by side (default: cpu)")
    args = ap.parse_args()
    devices = args.devices.split(",")
    s1, s2 = map(int, args.steps.split(","))
    spec = ModelSpec("resnet20", {"width": args.width})
    torch.manual_seed(0)
    model = spec.build().eval()
    layout = ParameterLayout.from_model(model)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(args.n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.n,), generator=g)
    curv, _ = capture("kron", model, x, y, 128, "exact", "fast", kfac="reduce")
    w0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    work = Path(tempfile.mkdtemp(prefix="serversize_"))
    paths = []
    for c in range(args.clients):
        comps = []
        for m in range(args.components):
            s = 1.0 + 0.1 * c + 0.01 * m
            blocks = [Kron(b.B * s, b.A) if isinstance(b, Kron) else b for b in curv.blocks]
            w = w0 + 0.01 * torch.randn(w0.shape, generator=g)
            comps.append(Component(m, w, BlockDiag(blocks), frozen_mapping({"seed": m}), 0.1, 10.0))
        paths.append(work / f"client_{c}.h5")
        write_client_artifact(paths[-1], spec, layout, {"n_data": 1000, "class_counts": [100] * 10, "temperature": 0.1,
                                                       "prior_precision": 10.0, "structure": "kron"}, comps,
                             Compression(args.compress, args.compress_metric, args.compress_vectors))
    row = {"width": args.width, "parameters": layout.dim, "clients": args.clients, "components": args.components,
           "compress": args.compress,
           "compress_metric": args.compress_metric, "compress_vectors": args.compress_vectors, "artifact_mb": round(sum(p.stat().st_size for p in paths) / 1e6 / args.clients, 1)}
    rows = []
    for device in devices:
        rows.append(dict(row, device=device, **fuse_runs(paths, work, args, s1, s2, device)))
        print(json.dumps(rows[-1]), flush=True)
        save_rows(args.json, rows[0] if len(rows) == 1 else rows)  # after each device: a stopped run keeps its rows


def fuse_runs(paths: list[Path], work: Path, args, s1: int, s2: int, device: str) -> dict:
    """The whole run (``--whole``) or the three runs that split set-up, steps and the Laplace step."""
    if args.whole is not None:
        run = fuse(paths, work / "g.h5", args.whole.split(","), args.max_memory, device)
        out = {"whole": run, "seconds": run["seconds"], "peak_mib": run["peak_mib"], "gpu_peak_mib": run["gpu_peak_mib"]}
        if device == "cuda":
            out["gpu_estimate_mib"] = device_estimate_mib(paths, args.whole.split(","))
        return out
    settings = ([f"steps={s1}", "laplace=false", "solver=adam"], [f"steps={s2}", "laplace=false", "solver=adam"],
                [f"steps={s1}", "solver=adam"])
    runs = [fuse(paths, work / f"g{i}.h5", st, args.max_memory, device) for i, st in enumerate(settings)]
    out: dict = {"runs": runs}
    if device == "cuda":
        out["gpu_estimate_mib"] = device_estimate_mib(paths, settings[2])
    if all(r["exit"] == 0 for r in runs):
        per_step = (runs[1]["seconds"] - runs[0]["seconds"]) / (s2 - s1)
        out.update(seconds_per_step=round(per_step, 2), setup_s=round(runs[0]["seconds"] - s1 * per_step, 1),
                   laplace_s=round(runs[2]["seconds"] - runs[0]["seconds"], 1),
                   peak_mib=max(r["peak_mib"] for r in runs))
        if device == "cuda":
            out["gpu_peak_mib"] = max(r["gpu_peak_mib"] or 0 for r in runs)
    return out


if __name__ == "__main__":
    main()
