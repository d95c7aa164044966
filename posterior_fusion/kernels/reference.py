"""Torch reference for the batched Kronecker quadratic forms (CPU path and test oracle).

Shapes, for one weight matrix of shape ``(P, Q)`` = ``(out, in)`` and N stacked components:

* ``W``  ``(K, P, Q)``  — K evaluation points (one per global mode)
* ``mu`` ``(N, P, Q)``  — component means
* ``UB`` ``(N, P, R1)``, ``UA`` ``(N, Q, R2)`` — eigenbases of the factors (R = P, Q when
  exact; fewer columns after low-rank truncation)
* ``S``  ``(N, R1, R2)`` — weights of the rotated entries (``b aᵀ / T + λ0`` when exact)

``q[k, n] = Σ_ij (UB[n]ᵀ (W[k] − mu[n]) UA[n])_ij² S[n]_ij``, and
``∂/∂W[k] Σ_n g[k, n] q[k, n] = Σ_n 2 g[k, n] UB[n] (Z[k, n] ∘ S[n]) UA[n]ᵀ``.
"""

from __future__ import annotations

import torch


def rotate(W: torch.Tensor, mu: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor) -> torch.Tensor:
    """``Z[k, n] = UB[n]ᵀ (W[k] − mu[n]) UA[n]``, shape ``(K, N, R1, R2)``."""
    V = W[:, None] - mu[None]
    return UB.transpose(-1, -2) @ V @ UA


def quadratic_forms(W: torch.Tensor, mu: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor,
                    S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q (K, N), Z (K, N, R1, R2))``."""
    Z = rotate(W, mu, UB, UA)
    return (Z.square() * S).sum((-2, -1)), Z


def quadratic_forms_grad(Z: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor, S: torch.Tensor,
                         grad_q: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. ``W`` ``(K, P, Q)`` of ``Σ grad_q ∘ q``."""
    Y = 2 * grad_q[..., None, None] * Z * S
    return (UB @ Y @ UA.transpose(-1, -2)).sum(1)

