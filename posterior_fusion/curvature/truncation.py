"""The compression of a Kronecker factor: eigendecomposition, truncation to a budget, the stored error and the
precision metric's bounds (the maths :class:`~posterior_fusion.curvature.compressed.CompressedKron` stores)."""

from __future__ import annotations

import torch

HALF_SHARE = 0.9  # the truncation's share of the budget where eigenvectors are rounded to float16
ROUNDING_SHARE = 0.2  # the most of the budget the rounding alone may cost (against the float32 form)


def factor_eigh(F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """F's float64 eigendecomposition (ascending, of the symmetrised F): computed once per factor and
    shared by :func:`truncate`, :func:`stored_error` and :func:`split_half`."""
    Fd = F.double()
    return torch.linalg.eigh(0.5 * (Fd + Fd.T))


def truncate(F: torch.Tensor, budget: float, floor: float | None = None,
             eig: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``(U (D, r), λ (r,), σ, error)`` of the smallest r whose low-rank-plus-isotropic approximation of
    the PSD ``F`` ``(D, D)`` has an error ≤ ``budget`` (r = D, σ = 0 and error 0 when no smaller rank
    does; all of F is then kept). ``floor`` None: the relative Frobenius error, σ keeping the trace;
    a floor ``f`` ≥ 0: the precision metric (module docstring), ``max_{i>r} |λ_i − σ| / (λ_i + f)``.
    ``eig``: :func:`factor_eigh` of F where the caller has it."""
    D = F.shape[0]
    lam, U = factor_eigh(F) if eig is None else eig
    lam, U = lam.flip(0).clamp(min=0), U.flip(1)  # descending
    total = float(lam.square().sum())
    if total == 0.0 or floor == float("inf"):  # a zero factor, or one whose block the other factor zeroes
        return U[:, :0].to(F.dtype), lam[:0].to(F.dtype), float(lam.mean()), 0.0
    tails = lam.flip(0).cumsum(0).flip(0)  # tails[r] = Σ_{i>=r} λ_i
    for r in range(0, D):
        if floor is None:
            sigma = float(tails[r]) / (D - r)
            err = float((lam[r:] - sigma).square().sum()) ** 0.5 / total**0.5
        else:  # the level equalising the relative errors at the tail's two ends
            hi, lo = float(lam[r]), float(lam[-1])
            sigma = (2 * hi * lo + floor * (hi + lo)) / (hi + lo + 2 * floor) if hi + floor > 0 else 0.0
            err = max(0.0, (hi - sigma) / (hi + floor)) if hi + floor > 0 else 0.0  # ≥ 0 through rounding
        if err <= budget:
            return U[:, :r].to(F.dtype).contiguous(), lam[:r].to(F.dtype), sigma, err
    return U.to(F.dtype).contiguous(), lam.to(F.dtype), 0.0, 0.0


def orthonormalise(U: torch.Tensor) -> torch.Tensor:
    """The orthonormal basis nearest ``U`` ``(D, r)`` (Löwdin: ``U (UᵀU)^{-1/2}``), in float64: how a
    reader turns stored float16 eigenvectors back into an exact orthonormal basis."""
    Ud = U.double()
    if Ud.shape[1] == 0:
        return Ud
    w, Q = torch.linalg.eigh(Ud.T @ Ud)
    return Ud @ ((Q * w.clamp(min=1e-12).rsqrt()) @ Q.T)


def stored_error(F: torch.Tensor, U: torch.Tensor, lam: torch.Tensor, sigma: float,
                 floor: float | None = None, eig: tuple[torch.Tensor, torch.Tensor] | None = None,
                 reference: torch.Tensor | None = None) -> float:
    """The error of ``F̃ = U diag(λ) Uᵀ + σ (I − U Uᵀ)`` against the PSD ``F`` ``(D, D)`` for any
    orthonormal ``U`` ``(D, r)`` (not only F's own eigenvectors), in float64: ``floor`` None, the
    relative Frobenius error ``‖F − F̃‖_F / ‖F‖_F``; a floor ``f``, the precision metric's
    ``‖(F + f I)^{-1/2} (F̃ − F) (F + f I)^{-1/2}‖₂`` — for eigenvectors of F exactly the worst ratio
    ``|λ_i − σ| / (λ_i + f)`` of :func:`truncate`, and in general the bound on every quadratic form.
    ``eig``: F's float64 ``eigh`` (where the caller evaluates several forms of one factor). Computed in
    F's eigenbasis Q, where ``Qᵀ F̃ Q = σ I + (QᵀU) diag(λ − σ) (QᵀU)ᵀ`` and ``Qᵀ F Q`` is diagonal: no
    ``D × D × D`` product beyond the one decomposition (and, for the precision metric, one ``eigvalsh``).
    ``reference``: another orthonormal basis U' ``(D, r)``: the error of F̃ against the form with U' and the
    same λ, σ instead of against F, in F's metric (what a change of basis alone costs)."""
    if floor == float("inf"):
        return 0.0
    lamF, Q = factor_eigh(F) if eig is None else eig

    def in_basis(B: torch.Tensor) -> torch.Tensor:  # Qᵀ F̃ Q − σ I for the form with basis B
        V = Q.T @ B.double()
        return (V * (lam.double() - sigma)) @ V.T

    diff = in_basis(U)
    if reference is None:
        diff.diagonal().add_(sigma - lamF)  # Qᵀ (F̃ − F) Q
    else:
        diff -= in_basis(reference)
    if floor is None:
        total = float(lamF.norm())
        return float(diff.norm()) / total if total > 0 else 0.0
    w = (lamF.clamp(min=0) + floor).rsqrt() if floor > 0 else lamF.clamp(min=1e-300).rsqrt()
    M = w[:, None] * diff * w[None, :]
    return float(torch.linalg.eigvalsh(0.5 * (M + M.T)).abs().max()) if M.numel() else 0.0


def joined(lead: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The kept eigenvectors as a reader rebuilds them: the float32 ``lead`` ``(D, k)`` and float16 ``tail``
    ``(D, h)`` side by side, made orthonormal (float64 ``(D, k + h)``)."""
    return orthonormalise(torch.cat([lead.double(), tail.double()], 1))


def split_half(F: torch.Tensor, budget: float, floor: float | None = None,
               eig: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None:
    """``(lead (D, k), tail (D, h) float16, λ (k + h,), σ, error)``: F's top eigenpairs within
    ``HALF_SHARE · budget`` (:func:`truncate`), the leading k eigenvectors kept in F's dtype and the other h
    rounded to float16, k the smallest whose stored form (:func:`joined`, in F's dtype as a reader holds
    it) has an error ≤ ``budget`` and whose rounding alone (against the float32 form, same metric) costs
    ≤ ``ROUNDING_SHARE · budget`` — the rounding's error is not confined to the prior-dominated tail as
    the truncation's is, and moves methods that solve with information vectors ``Λ ŵ`` (HBFL) more. k =
    0, 1, 2, 4, … until one passes, then bisection (a few dense evaluations; k is 1 or 2 on trained
    K-FAC factors). None where no vector can be halved."""
    eig = factor_eigh(F) if eig is None else eig
    U, lam, sigma, _ = truncate(F, HALF_SHARE * budget, floor, eig)
    r = U.shape[1]
    if r == 0:
        return None

    passed: dict[int, float] = {}  # k -> its stored form's error, for every k that met both bounds

    def passes(k: int) -> bool:
        stored = joined(U[:, :k], U[:, k:].half()).to(F.dtype)
        err = stored_error(F, stored, lam, sigma, floor, eig)
        if err <= budget and stored_error(F, stored, lam, sigma, floor, eig, reference=U) <= ROUNDING_SHARE * budget:
            passed[k] = err
            return True
        return False

    lo, hi = 0, r  # k = r is the truncation's own form, within HALF_SHARE · budget
    step = 0
    while step < r:  # the first passing k of 0, 1, 2, 4, ...: the answer lies in (the last failing k, it]
        if passes(step):
            hi = step
            break
        lo = step + 1
        step = max(1, 2 * step)
    while lo < hi:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid + 1
    if lo == r:
        return None
    return U[:, :lo], U[:, lo:].half(), lam, sigma, passed[lo]  # lo < r was the last k that passed


def rebuild(U: torch.Tensor, lam: torch.Tensor, sigma: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The factor ``U diag(λ) Uᵀ + σ (I − U Uᵀ)`` ``(D, D)`` in ``dtype`` (computed in float64)."""
    Ud, ld = U.double(), lam.double()
    F = (Ud * (ld - sigma)) @ Ud.T + sigma * torch.eye(U.shape[0], dtype=torch.float64)
    return (0.5 * (F + F.T)).to(dtype)
