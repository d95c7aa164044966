"""Torch reference implementations of the batched Kronecker operations (CPU and oracle).

Shapes: N stacked components of one weight matrix of shape ``(out, in)``.
``UB`` ``(N, out, out)`` and ``UA`` ``(N, in, in)`` are orthogonal eigenbases of the
factors, ``S`` ``(N, out, in)`` the eigenvalue grid of Λ (``b aᵀ / T + λ0``).
"""

from __future__ import annotations

import torch


def kron_quadratic_form(V: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``q[..., n] = Σ_ij (UB[n]ᵀ V[..., n] UA[n])_ij² S[n]_ij``.

    ``V`` is ``(..., N, out, in)`` (leading dimensions broadcast, e.g. one per mode);
    returns ``(..., N)``. Differentiable through autograd; the gradient w.r.t. ``V`` is
    ``2 UB (Z ∘ S) UAᵀ``.
    """
    Z = UB.transpose(-1, -2) @ V @ UA
    return (Z.square() * S).sum((-2, -1))


def kron_sample(UB: torch.Tensor, UA: torch.Tensor, S: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``(U_B ⊗ U_A) diag(S^{-1/2}) eps`` per component: draws from ``N(0, Λ⁻¹)``.

    ``eps`` ``(..., N, out, in)`` standard normal; returns the same shape.
    """
    return UB @ (eps * S.rsqrt()) @ UA.transpose(-1, -2)
