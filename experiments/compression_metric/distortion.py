"""How far each compression metric moves the eigenvalues of the precision fusion sees.

    .venv/bin/python experiments/compression_metric/distortion.py

A Kronecker block whose factors' spectra span nine decades together (factor B over four, A over five
decades, random eigenbases, float64), T = 0.5, λ0 = 0.01, scale 1: compressed at each budget with
the ``frobenius`` and the ``precision`` metric; for every eigenvalue of the precision
``(1/T) B̃ ⊗ Ã + λ0 I`` its ratio to the plain block's (matched through the shared eigenvectors),
and the per-factor errors each records. Prints one markdown row per (metric, budget).
"""

from __future__ import annotations

import argparse

import torch

from posterior_fusion.curvature.compressed import CompressedKron
from posterior_fusion.curvature.kron import Kron
from posterior_fusion.curvature.truncation import rebuild


def factor(D: int, decades: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    return (Q * torch.logspace(0, -decades, D, dtype=torch.float64)) @ Q.T


def ratios(B: torch.Tensor, A: torch.Tensor, metric: str, budget: float, T: float, lam0: float):
    """Smallest and largest ratio of a compressed precision eigenvalue to the plain one, and the recorded errors."""
    block = Kron(B, A)
    c = CompressedKron.from_kron(block, budget, lam0 * T if metric == "precision" else None)
    Bt, At = rebuild(c.UB, c.lB, c.sB, torch.float64), rebuild(c.UA, c.lA, c.sA, torch.float64)
    lb, QB = torch.linalg.eigh(B)
    la, QA = torch.linalg.eigh(A)
    true = torch.outer(lb, la).flatten() / T + lam0
    got = torch.outer(torch.diagonal(QB.T @ Bt @ QB), torch.diagonal(QA.T @ At @ QA)).flatten() / T + lam0
    r = got / true
    return float(r.min()), float(r.max()), c.errors, (c.lB.numel(), c.lA.numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="0.02,0.05,0.1", help="comma-separated relative error budgets")
    args = ap.parse_args()
    B, A = factor(24, 4.0, 0), factor(40, 5.0, 1)
    print("| metric | budget | ranks (B, A) of (24, 40) | recorded errors (B, A) | precision eigenvalue ratio, min – max |")
    print("|---|---|---|---|---|")
    for metric in ("frobenius", "precision"):
        for budget in (float(b) for b in args.budgets.split(",")):
            lo, hi, errors, ranks = ratios(B, A, metric, budget, 0.5, 0.01)
            print(f"| {metric} | {budget:g} | {ranks[0]}, {ranks[1]} | {errors[0]:.3f}, {errors[1]:.3f} | "
                  f"{lo:.3g} – {hi:.3g} |")


if __name__ == "__main__":
    main()
