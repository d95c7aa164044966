"""Two preconditioners of the Kronecker-sum solver on real client factors.

``solve_kron_sum`` inverts ``X ↦ Σ_k w_k B_k X A_kᵀ + shift · X`` by preconditioned conjugate
gradients with ``(B̄ + s_B I)⁻¹ ⊗ (Ā + s_A I)⁻¹``, the shift split between the factors ("split", the
library's); an alternative is ``(B̄ ⊗ Ā + shift · I)⁻¹`` through the factors' eigenbases ("eigen",
exact in the shift; read from git, commit c5e70a8). This runs both on every Kronecker layer of the clients' component 0 for two systems — FedFisher's
exact solve (raw curvature, shift = ``prior_scale`` × mean curvature) and the first EM step of fedbens
(Λ_c = G_c / T_c + λ_c I, shift λ0 = the clients' λ) — and reports iterations, seconds and the
relative residual reached, side by side in one process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kron_preconditioner_bench.py \\
        --clients runs/resnet20_fmnist/clients/<key> --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import posterior_fusion
from posterior_fusion.curvature import Kron
from posterior_fusion.experiment.measure import save_rows
from posterior_fusion.fusion.layer_solve import solve_kron_sum

TRIED = "c5e70a8"


def tried_solver():
    """``solve_kron_sum`` with the eigen preconditioner, as at :data:`TRIED`."""
    source = subprocess.run(["git", "show", f"{TRIED}:posterior_fusion/fusion/layer_solve.py"], capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "layer_solve_eigen.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("layer_solve_eigen", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.solve_kron_sum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", required=True, help="folder of post_<i>.h5 client artifacts (Kronecker)")
    ap.add_argument("--damping", type=float, default=0.01, help="FedFisher system's prior_scale (relative prior precision; default 0.01)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eigen = tried_solver()
    comps = [posterior_fusion.load(p).components[0] for p in sorted(Path(args.clients).glob("post_*.h5"))]
    rows = []
    for j, block in enumerate(comps[0].curvature.blocks):
        if not isinstance(block, Kron):
            continue
        blocks = [c.curvature.blocks[j] for c in comps]
        off = comps[0].curvature.offsets[j]
        mean_curv = sum(float(b.diagonal().double().mean()) for b in blocks)
        systems = {"fedfisher": ([1.0] * len(comps), args.damping * mean_curv),
                   "fedbens-em": ([1.0 / c.temperature for c in comps],
                                  sum(c.prior_precision for c in comps) - (sum(c.prior_precision for c in comps)
                                                                           - comps[0].prior_precision))}
        for system, (weights, shift) in systems.items():
            # λ_c I of every client plus the server's λ0 minus the over-counted Σ λ_c: λ0 in all
            w = torch.tensor(weights, dtype=torch.float64)
            rhs = sum(wk * b.astype(torch.float64).with_scale_shift(1.0, 0.0).matvec(c.map[off: off + b.dim].double())
                      for wk, b, c in zip(w, blocks, comps)).reshape(block.shape)
            row = {"layer": j, "shape": list(block.shape), "system": system, "shift": shift}
            for name, solve in (("split", solve_kron_sum), ("eigen", eigen)):
                t0 = time.perf_counter()
                _, it, res = solve([b.B for b in blocks], [b.A for b in blocks], w, rhs, shift=shift)
                row.update({f"{name}_iterations": it, f"{name}_seconds": round(time.perf_counter() - t0, 3),
                            f"{name}_residual": res})
            rows.append(row)
            print(json.dumps(row), flush=True)
    for system in ("fedfisher", "fedbens-em"):
        sel = [r for r in rows if r["system"] == system]
        print(system, {k: round(sum(r[k] for r in sel), 2) for k in ("split_iterations", "eigen_iterations",
                                                                   "split_seconds", "eigen_seconds")},
              "worst residual split/eigen", max(r["split_residual"] for r in sel), max(r["eigen_residual"] for r in sel))
    save_rows(args.json, rows)


if __name__ == "__main__":
    main()
