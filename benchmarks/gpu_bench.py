"""The fedbens server on a CUDA GPU: Triton kernels against torch on the same GPU, and the CPU, in one run.

    python benchmarks/gpu_bench.py --artifacts '<5 LeNet kron client artifacts, M = 5>' --out gpu.json

Three parts, each configuration timed side by side in one process:

1. **Objective step** — ``GlobalLogPosterior.value_and_gradient`` (what ``pfuse fuse`` runs per
   Adam step: K = M modes against N = C·M stacked components) with ``kernel="torch"`` (batched
   cuBLAS products, direct form; replayed from a CUDA graph, and eagerly) and ``kernel="triton"``
   (the fused direct-form kernels) on the GPU, beside the rotated autograd step of before
   the batched server step (torch and Triton, eager) on the GPU and
   the objective on the CPU (``--cpu-threads``; only where C·M ≤ ``--cpu-max-pairs``). Real
   client components are repeated to reach C clients of M components. Values and gradients of
   the two GPU kernels are compared (max relative difference), and against the CPU float64
   objective for the smallest configurations.
2. **One large layer** — the direct forms and their gradient for the paper CNN's 1600 → 512
   layer (random PSD factors), N components, torch vs Triton: ms and GFLOP/s counted as the
   direct form's products (2·(P²Q + PQ²) per pair; Triton recomputes them for the gradient).
3. **Whole fedbens** on the given artifacts (``--steps`` Adam steps per mode, ``laplace=False``):
   wall seconds on the CPU, on the GPU with torch and with Triton; the largest difference of the
   modes found.

GPU times: ``torch.cuda.synchronize()`` around each call, the median over at least 20 calls and
0.3 s of them after two warm-up calls. Peak: ``torch.cuda.max_memory_allocated`` during the steps
minus what was allocated before them.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import time

import torch
from server_step_bench import repeat_components, rotated_step

import posterior_fusion
from posterior_fusion.experiment.measure import sync
from posterior_fusion.fusion import FusionOptions, fuse_clients
from posterior_fusion.fusion.gaussian_stack import StackedGaussians
from posterior_fusion.fusion.methods.fedbens import GlobalLogPosterior
from posterior_fusion.kernels import kron_direct_forms_and_vjp


def median_ms(step, min_calls: int = 20, min_ms: float = 300.0) -> float:
    """Median milliseconds of ``step()`` (synchronised) after two warm-up calls."""
    step()
    step()
    times: list[float] = []
    while len(times) < min_calls or sum(times) < min_ms:
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def peak_mib(step) -> float:
    """Extra GPU memory (MiB) allocated at peak during one ``step()``."""
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def objective_row(clients, C: int, M: int, cpu_threads: int, cpu_max_pairs: int, triton_max_pairs: int) -> dict:
    per_client, comps = repeat_components(clients, C, M)
    W_cpu = torch.stack([comps[k].map for k in range(M)]).float() + 0.01
    W = W_cpu.cuda()
    row: dict = {"C": C, "M": M}
    out = {}
    kernels = ("torch", "triton") if C * M <= triton_max_pairs else ("torch",)
    for kernel in kernels:
        obj = GlobalLogPosterior(per_client, [0.1] * C, [10.0] * C, 10.0, torch.float32, kernel=kernel, device="cuda")
        row[f"objective_{kernel}_ms"] = round(median_ms(lambda o=obj: o.value_and_gradient(W)), 3)
        row[f"objective_{kernel}_peak_mib"] = round(peak_mib(lambda o=obj: o.value_and_gradient(W)), 1)
        out[kernel] = obj.value_and_gradient(W)
        if kernel == "torch":  # the same step without CUDA graphs (every kernel launched from Python)
            eager = GlobalLogPosterior(per_client, [0.1] * C, [10.0] * C, 10.0, torch.float32, kernel=kernel,
                                       device="cuda", cuda_graphs=False)
            row["objective_torch_eager_ms"] = round(median_ms(lambda e=eager: e.value_and_gradient(W)), 3)
            v, g = eager.value_and_gradient(W)
            row["graph_vs_eager_rel_value"] = rel(out["torch"][0], v)
            row["graph_vs_eager_rel_grad"] = rel(out["torch"][1], g)
    if "triton" in out:
        row["triton_vs_torch_rel_value"] = rel(out["triton"][0], out["torch"][0])
        row["triton_vs_torch_rel_grad"] = rel(out["triton"][1], out["torch"][1])
    for kernel in kernels:
        step = rotated_step(StackedGaussians(comps, 1 / 0.1, 10.0, torch.float32, kernel=kernel).to("cuda"), W)
        row[f"rotated_{kernel}_ms"] = round(median_ms(step), 3)
        row[f"rotated_{kernel}_peak_mib"] = round(peak_mib(step), 1)
    if C * M <= cpu_max_pairs:
        torch.set_num_threads(cpu_threads)
        cpu = GlobalLogPosterior(per_client, [0.1] * C, [10.0] * C, 10.0, torch.float32, kernel="torch")
        row[f"objective_cpu{cpu_threads}t_ms"] = round(median_ms(lambda: cpu.value_and_gradient(W_cpu), 5, 500), 3)
        if C * M <= 25:
            ref = GlobalLogPosterior(per_client, [0.1] * C, [10.0] * C, 10.0, torch.float64, kernel="torch")
            v64, g64 = ref.value_and_gradient(W_cpu.double())
            for kernel, (v, g) in out.items():
                row[f"{kernel}_vs_cpu_float64_rel_value"] = rel(v, v64)
                row[f"{kernel}_vs_cpu_float64_rel_grad"] = rel(g, g64)
    row["speedup_rotated_torch_over_objective_torch"] = round(row["rotated_torch_ms"] / row["objective_torch_ms"], 2)
    row["speedup_eager_over_graph"] = round(row["objective_torch_eager_ms"] / row["objective_torch_ms"], 2)
    if "triton" in out:
        row["speedup_objective_triton_over_torch"] = round(row["objective_triton_ms"] / row["objective_torch_ms"], 2)
    print(json.dumps(row), flush=True)
    return row


def large_layer_row(N: int, K: int = 5, P: int = 512, Q: int = 1600) -> dict:
    g = torch.Generator(device="cuda").manual_seed(N)
    XB = torch.randn(N, P, P + 8, generator=g, device="cuda") / (P + 8) ** 0.5
    XA = torch.randn(N, Q, Q + 8, generator=g, device="cuda") / (Q + 8) ** 0.5
    B, A = XB @ XB.transpose(1, 2), XA @ XA.transpose(1, 2)
    del XB, XA
    mu = 0.01 * torch.randn(N, P, Q, generator=g, device="cuda")
    W = 0.01 * torch.randn(K, P, Q, generator=g, device="cuda")
    Bmu = B @ mu
    scale, shift = torch.full((N,), 10.0, device="cuda"), torch.full((N,), 10.0, device="cuda")
    mu_sq = mu.flatten(1).square().sum(1)
    gq = torch.randn(K, N, generator=g, device="cuda")
    row: dict = {"layer": f"{P}x{Q}", "K": K, "N": N}
    res = {}
    for kernel in ("torch", "triton"):
        def step(kernel=kernel):
            q, vjp = kron_direct_forms_and_vjp(W, mu, B, A, Bmu, scale, shift, kernel, mu_sq)
            return q, vjp(gq)

        ms = median_ms(step, 5, 200)
        passes = 1 if kernel == "torch" else 2  # Triton recomputes B V A in the gradient pass
        row[f"{kernel}_ms"] = round(ms, 2)
        row[f"{kernel}_tflops"] = round(passes * 2 * (P * P * Q + P * Q * Q) * K * N / ms / 1e9, 2)
        row[f"{kernel}_peak_mib"] = round(peak_mib(step), 1)
        res[kernel] = step()
    row["triton_vs_torch_rel_value"] = rel(res["triton"][0], res["torch"][0])
    row["triton_vs_torch_rel_grad"] = rel(res["triton"][1], res["torch"][1])
    print(json.dumps(row), flush=True)
    return row


def whole_fuse_rows(clients, steps: int, cpu_threads: int) -> list[dict]:
    rows, modes = [], {}
    for label, device, kernel in (("cpu", "cpu", None), ("cuda", "cuda", None), ("cuda-triton", "cuda", "triton")):
        torch.set_num_threads(cpu_threads)
        sync()
        t0 = time.perf_counter()
        _, res, _ = fuse_clients(clients, "fedbens", FusionOptions(progress=False, device=device, kernel=kernel),
                                 {"steps": steps, "laplace": False, "clip": 1e9, "solver": "adam"})
        sync()
        seconds = time.perf_counter() - t0
        modes[label] = [m.cpu() for m in res.members]
        row = {"fuse": label, "steps": steps, "seconds": round(seconds, 2), "cpu_threads": cpu_threads}
        if label != "cpu":
            row["max_abs_diff_modes_vs_cpu"] = max((a - b).abs().max().item() for a, b in zip(modes[label], modes["cpu"]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True, help="glob of LeNet kron client artifacts")
    ap.add_argument("--grid", default=",".join(f"{c}x{m}" for c in (5, 10, 20, 40) for m in (1, 2, 5, 10)),
                    help="CxM configurations (default: C = 5, 10, 20, 40 times M = 1, 2, 5, 10)")
    ap.add_argument("--cpu-threads", type=int, default=1, help="CPU threads of the CPU columns (default: 1)")
    ap.add_argument("--cpu-max-pairs", type=int, default=50, help="CPU objective only where C·M <= this (default: 50)")
    ap.add_argument("--triton-max-pairs", type=int, default=50, help="Triton columns only where C·M <= this (default: 50)")
    ap.add_argument("--large-sizes", default="5,25", help="N of the 1600x512 layer part (default: %(default)s; '' = skip)")
    ap.add_argument("--steps", type=int, default=100, help="Adam steps per mode of the whole fedbens part (default: 100)")
    ap.add_argument("--out", required=True, help="JSON file for every row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA GPU here")
    import triton

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cpu_threads": args.cpu_threads, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    print(json.dumps(info), flush=True)
    clients = [posterior_fusion.load(p) for p in sorted(glob.glob(args.artifacts))]
    grid = [tuple(map(int, c.split("x"))) for c in args.grid.split(",")]
    out = {"info": info, "objective": [objective_row(clients, C, M, args.cpu_threads, args.cpu_max_pairs, args.triton_max_pairs)
                                   for C, M in grid]}
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    out["large_layer"] = []
    for n in filter(None, args.large_sizes.split(",")):
        out["large_layer"].append(large_layer_row(int(n)))
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    out["whole_fuse"] = whole_fuse_rows(clients, args.steps, args.cpu_threads)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
