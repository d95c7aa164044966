"""Whole fedbens server optimisation, ours vs the FedBEns authors' way, side by side in one run.

    .venv/bin/python benchmarks/authors_loop_bench.py \
        --artifacts 'runs/table1_seeds12/clients/80b78048283034d5/post_*.h5' --steps 100 --threads 1

"authors": as their server (``One_shot_FL``): one global mode at a time (M sequential runs), each
Adam step evaluating −log p(w|D) with a Python loop over the C·M client components, each through
laplace-torch's ``KronDecomposed`` (log-determinants included), ``torch.optim.Adam``. "ours":
``fuse_clients(..., "fedbens", steps, laplace=False)`` — all modes and components batched, the
direct-form Kronecker objective, our plain Adam. Same starts (per-mode medians), same objective.
"""

from __future__ import annotations

import argparse
import glob
import time

import torch
from kron_bench import kron_decomposed

import posterior_fusion
from posterior_fusion.fusion import FusionInputs, FusionOptions, fuse_clients
from posterior_fusion.fusion.methods.fedbens import median_starts


def authors_objective(clients, temperature: float, lam: float):
    groups = [[(comp.map, kron_decomposed(comp, temperature, lam)) for comp in c.components] for c in clients]
    m = len(groups[0])

    def neg_log_post(w: torch.Tensor) -> torch.Tensor:
        total = 0.5 * (len(groups) - 1) * lam * w.square().sum()  # over-counted prior, removed
        for comps in groups:
            terms = []
            for mu, dec in comps:
                v = (w - mu)[None, None]
                quad = (v * dec.bmm(v, exponent=1)).sum()
                terms.append(-0.5 * quad + 0.5 * dec.logdet() - torch.log(torch.tensor(float(m))))
            total = total - torch.logsumexp(torch.stack(terms), 0)
        return total

    return neg_log_post


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="call posterior_fusion.runtime.keep_freed_memory() first, as pfuse does (both loops then reuse freed buffers)")
    args = ap.parse_args()
    if args.keep_freed_memory:
        from posterior_fusion.runtime import keep_freed_memory

        keep_freed_memory()
    torch.set_num_threads(args.threads)
    clients = [posterior_fusion.load(p) for p in sorted(glob.glob(args.artifacts))]
    c0 = clients[0]
    T, lam = c0.components[0].temperature, c0.components[0].prior_precision
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    starts = median_starts(inputs, c0.num_components)

    t0 = time.perf_counter()
    f = authors_objective(clients, T, lam)
    authors_modes = []
    for k in range(starts.shape[0]):  # one mode at a time
        w = starts[k].clone().requires_grad_(True)
        opt = torch.optim.Adam([w], lr=1e-3)
        for _ in range(args.steps):
            opt.zero_grad()
            f(w).backward()
            opt.step()
        authors_modes.append(w.detach())
    t_authors = time.perf_counter() - t0

    t0 = time.perf_counter()
    _, res, _ = fuse_clients(clients, "fedbens", FusionOptions(progress=False),
                             {"steps": args.steps, "laplace": False, "clip": 1e9, "solver": "adam"})
    t_ours = time.perf_counter() - t0
    gap = max((a - b).abs().max().item() for a, b in zip(authors_modes, res.members))
    print(f"C = {len(clients)}, M = {c0.num_components}, d = {c0.layout.dim}, {args.steps} Adam steps per mode, "
          f"threads = {args.threads}, keep freed memory = {args.keep_freed_memory}")
    print(f"authors' loop: {t_authors:.1f} s | ours: {t_ours:.1f} s | speed-up {t_authors / t_ours:.2f}x | "
          f"largest difference of the modes found {gap:.2e}")


if __name__ == "__main__":
    main()
