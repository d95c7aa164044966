"""Exact solves of sums of Kronecker-factored precisions, one weight at a time: the operator

    X ↦ Σ_k w_k B_k X A_kᵀ + shift · X        (X (out, in); B_k (out, out), A_k (in, in) PSD)

is SPD (a weighted sum of Kronecker products of PSD factors, plus a shift) and is inverted by
conjugate gradients preconditioned with one Kronecker product, ``(B̄ + s_B I)⁻¹ · (Ā + s_A I)⁻¹``
(``B̄ = Σ w_k B_k``, ``Ā`` the w-weighted mean of the ``A_k``, ``s_A s_B = shift`` split in
proportion to the factors' mean eigenvalues), which is exact for a single term. Used by FedLPA's
aggregation and by the EM mode finder of fedbens (``fusion/em.py``).
"""

from __future__ import annotations

import math

import torch


def _inverse(F: torch.Tensor) -> torch.Tensor:
    """Inverse of an SPD matrix ``(k, k)`` through its Cholesky factor."""
    return torch.cholesky_inverse(torch.linalg.cholesky(F))


def solve_kron_sum(Bs: list[torch.Tensor], As: list[torch.Tensor], w: torch.Tensor, rhs: torch.Tensor,
                   shift: float = 0.0, start: torch.Tensor | None = None, tolerance: float = 1e-10,
                   max_iterations: int = 1000) -> tuple[torch.Tensor, int, float]:
    """``X`` ``(out, in)`` with ``Σ_k w_k B_k X A_kᵀ + shift·X = rhs``; returns ``(X, iterations,
    relative residual)``. ``start``: the first iterate (default: the preconditioner applied to
    ``rhs``). Float64 arithmetic throughout, whatever the factors' dtype: each factor is converted where
    a product uses it, one term at a time, so float32 factors never exist as float64 all at once (for EM at
    C·M = 25 on a 2304-input layer, the copies of every term's ``A`` were 1 GB); ``tolerance`` is on
    ``‖residual‖ / ‖rhs‖``."""
    f64 = torch.float64

    def op(X: torch.Tensor) -> torch.Tensor:
        out = sum(wk * (B.to(f64) @ X @ A.to(f64).T) for wk, B, A in zip(w, Bs, As))
        return out + shift * X if shift else out

    Bbar = sum(wk * B.to(f64) for wk, B in zip(w, Bs))
    Abar = sum(wk * A.to(f64) for wk, A in zip(w, As)) / float(sum(w))  # (Σ w B) ⊗ (mean A): exact for one term
    if shift:
        a = max(float(torch.diagonal(Abar).mean()), 1e-300)
        b = max(float(torch.diagonal(Bbar).mean()), 1e-300)
        sA, sB = math.sqrt(shift * a / b), math.sqrt(shift * b / a)
        Bbar = Bbar + sB * torch.eye(Bbar.shape[0], dtype=Bbar.dtype)
        Abar = Abar + sA * torch.eye(Abar.shape[0], dtype=Abar.dtype)
    iB, iA = _inverse(Bbar), _inverse(Abar)

    def precondition(R: torch.Tensor) -> torch.Tensor:
        return iB @ R @ iA

    X = precondition(rhs) if start is None else start.clone()
    norm = float(rhs.norm()) or 1.0
    R = rhs - op(X)
    residual = float(R.norm()) / norm
    P = Y = precondition(R)
    ry = (R * Y).sum()
    it = 0
    while residual > tolerance and it < max_iterations:
        Q = op(P)
        step = ry / (P * Q).sum()
        X, R = X + step * P, R - step * Q
        residual = float(R.norm()) / norm
        it += 1
        Y = precondition(R)
        ry, ry_old = (R * Y).sum(), ry
        P = Y + (ry / ry_old) * P
    return X, it, residual
