"""Forward + backward of the Kronecker quadratic forms per Adam step, side by side.

    .venv/bin/python benchmarks/kron_bench.py --artifacts 'runs/fmnist-a0.1-kron/post_*.h5' \
        --sizes 5,25,100,200 --cnn-sizes 5,25 --out runs/kron-bench.json

Compares, for one point w against N components (the cost of one Adam step of one mode):
  loop     laplace-torch's KronDecomposed, one component at a time (the naive per-component loop)
  batched  posterior_fusion.kernels torch reference, all N components at once (exact)
  lowrank  batched with the exact low-rank shortcut at each of --spectral-cutoffs
  triton   fused Triton kernels (only when a CUDA GPU is present)
LeNet shapes use the real K-FAC factors of the given client artifacts (repeated cyclically
to reach N); the CNN layer (fc 1600->512) uses random orthogonal bases with a decaying
spectrum. Prints ms per step, ratios against the loop, and GFLOP/s counted as dense exact
FLOPs (4·(P²Q + PQ²) per component and layer), plus a large fp32 matmul rate measured in
the same run for reference.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import time

import torch

import posterior_fusion
from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.fusion.gaussian_stack import StackedGaussians
from posterior_fusion.kernels import triton_available
from posterior_fusion.posterior import Component

T, LAM = 0.1, 10.0


def timeit(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / timeit(lambda: a @ b, reps) / 1e9


def kron_decomposed(component: Component, temperature: float, lam: float):
    """laplace-torch's ``KronDecomposed`` of a component's precision ``G/T + λ0 I`` (as its users build it)."""
    from laplace.utils.matrix import KronDecomposed

    vecs, vals = [], []
    for blk in component.curvature.blocks:
        b, UB, a, UA = blk.eigen()
        vecs.append([UB, UA])
        vals.append([b / temperature, a])
    return KronDecomposed(vecs, vals, deltas=torch.full((len(vecs),), lam))


def laplace_loop(components: list[Component]):
    """Per-component quadratic forms with laplace-torch's KronDecomposed."""
    decs = [(c.map, kron_decomposed(c, T, LAM)) for c in components]

    def step(w: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for mu, dec in decs:
            v = (w - mu)[None, None]
            total = total + (v * dec.bmm(v, exponent=1)).sum()
        return total

    return step


def flops(components: list[Component]) -> float:
    per = sum(4 * (P * P * Q + P * Q * Q) for P, Q in (blk.shape for blk in components[0].curvature.blocks))
    return per * len(components)


def bench(name: str, components: list[Component], reps: int, tols: list[float], rate: float) -> list[dict]:
    n = len(components)
    w0 = components[0].map.clone() + 0.01
    rows = []
    loop = laplace_loop(components)
    exact = StackedGaussians(components, 1 / T, LAM, torch.float32, kernel="torch")
    lows = {tol: StackedGaussians(components, 1 / T, LAM, torch.float32, spectral_cutoff=tol, kernel="torch") for tol in tols}

    def run(obj):
        def f():
            w = w0.clone().requires_grad_(True)
            obj(w).sum().backward() if not callable(getattr(obj, "quadratic_forms", None)) else \
                obj.quadratic_forms(w[None]).sum().backward()
        return f

    t_loop = timeit(run(loop), reps)
    variants = [("loop", t_loop), ("batched", timeit(run(exact), reps))]
    variants += [(f"lowrank@{tol:g}", timeit(run(low), reps)) for tol, low in lows.items()]
    if torch.cuda.is_available() and triton_available():
        gpu = StackedGaussians(components, 1 / T, LAM, torch.float32, kernel="triton").to("cuda")
        w_gpu = w0.cuda()

        def tri():
            w = w_gpu.clone().requires_grad_(True)
            gpu.quadratic_forms(w[None]).sum().backward()

        variants.append(("triton", timeit(tri, reps)))
    w = (w0 + 0.05 * torch.randn_like(w0))[None]
    q_exact = exact.quadratic_forms(w)
    f = flops(components)
    for label, t in variants:
        row = {"shapes": name, "N": n, "variant": label, "ms": round(1e3 * t, 2), "speedup_vs_loop": round(t_loop / t, 2),
               "gflops_dense_equiv": round(f / t / 1e9, 1), "fraction_of_matmul_rate": round(f / t / 1e9 / rate, 3)}
        if label.startswith("lowrank@"):
            low = lows[float(label.split("@")[1])]
            rel = ((low.quadratic_forms(w) - q_exact).abs() / q_exact).max().item()
            kept = sum(r[2] * r[3] for r in low.ranks) / sum(r[0] * r[1] for r in low.ranks)
            row.update({"max_rel_change_q": rel, "kept_fraction_of_rotated_entries": round(kept, 4)})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def cnn_components(n: int, seed: int = 0) -> list[Component]:
    g = torch.Generator().manual_seed(seed)
    P, Q = 512, 1600
    bases = []
    for _ in range(min(n, 3)):
        UB = torch.linalg.qr(torch.randn(P, P, generator=g))[0]
        UA = torch.linalg.qr(torch.randn(Q, Q, generator=g))[0]
        b = torch.logspace(-6, 2, P)  # ascending, like eigh
        a = torch.logspace(-6, 0, Q)
        bases.append(((UB * b) @ UB.T, (UA * a) @ UA.T, (b, UB, a, UA)))
    out = []
    for i in range(n):
        B, A, eig = bases[i % len(bases)]
        k = Kron(B, A)
        k._eig = eig  # known decomposition: skip eigh of 1600x1600 per component
        out.append(Component(i, 0.01 * torch.randn(P * Q, generator=g), BlockDiag([k]), {}, T, LAM))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True, help="glob of kron client artifacts (LeNet)")
    ap.add_argument("--sizes", default="5,25,100,200")
    ap.add_argument("--cnn-sizes", default="5,25")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--spectral-cutoffs", default="1e-3,1e-2,1e-1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tols = [float(t) for t in args.lowrank_tols.split(",")]
    rate = matmul_rate()
    print(f"fp32 2048x2048 matmul: {rate:.1f} GFLOP/s; torch {torch.__version__}, threads {torch.get_num_threads()}", flush=True)
    real = [c for p in sorted(glob.glob(args.artifacts)) for c in posterior_fusion.load(p).components]
    rows = []
    for n in map(int, args.sizes.split(",")):
        rows += bench("lenet", [real[i % len(real)] for i in range(n)], args.reps, tols, rate)
    for n in map(int, filter(None, args.cnn_sizes.split(","))):
        rows += bench("cnn-fc1600x512", cnn_components(n), max(2, args.reps // 2), tols, rate)
    with open(args.out, "w") as fh:
        json.dump({"matmul_gflops": rate, "torch": torch.__version__, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
