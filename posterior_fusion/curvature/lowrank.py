"""A symmetric PSD factor as its top-r eigenpairs plus an isotropic remainder that keeps the trace:

    F ≈ F̃ = U diag(λ) Uᵀ + σ (I − U Uᵀ),   σ = (tr F − Σ λ) / (D − r)

``U`` ``(D, r)`` holds the r leading eigenvectors, ``λ`` ``(r,)`` their eigenvalues. F̃ shares F's
eigenvectors, so its relative Frobenius error is ``√(Σ_{i>r} (λ_i − σ)²) / ‖F‖_F`` from the
eigenvalues alone; :func:`truncate` takes the smallest r that meets a relative-error budget. Used by
the artifact's compressed Kronecker encoding (``artifact/blocks.py``, ``kron_lowrank``).
"""

from __future__ import annotations

import torch

from posterior_fusion.curvature.base import eigh_psd


def truncate(F: torch.Tensor, budget: float) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``(U (D, r), λ (r,), σ, relative error)`` of the smallest r whose low-rank-plus-isotropic
    approximation of the PSD ``F`` ``(D, D)`` has a relative Frobenius error ≤ ``budget``
    (r = D, σ = 0 and error 0 when no smaller rank does; all of F is then kept)."""
    D = F.shape[0]
    lam, U = eigh_psd(F.double())
    lam, U = lam.flip(0), U.flip(1)  # descending
    total = float(lam.square().sum())
    if total == 0.0:
        return U[:, :0].to(F.dtype), lam[:0].to(F.dtype), 0.0, 0.0
    tails = lam.flip(0).cumsum(0).flip(0)  # tails[r] = Σ_{i>=r} λ_i
    for r in range(0, D):
        sigma = float(tails[r]) / (D - r)
        err = float((lam[r:] - sigma).square().sum()) ** 0.5 / total**0.5
        if err <= budget:
            return U[:, :r].to(F.dtype).contiguous(), lam[:r].to(F.dtype), sigma, err
    return U.to(F.dtype).contiguous(), lam.to(F.dtype), 0.0, 0.0


def rebuild(U: torch.Tensor, lam: torch.Tensor, sigma: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The factor ``U diag(λ) Uᵀ + σ (I − U Uᵀ)`` ``(D, D)`` in ``dtype`` (computed in float64)."""
    Ud, ld = U.double(), lam.double()
    F = (Ud * (ld - sigma)) @ Ud.T + sigma * torch.eye(U.shape[0], dtype=torch.float64)
    return (0.5 * (F + F.T)).to(dtype)
