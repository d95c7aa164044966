"""A symmetric PSD factor as its top-r eigenpairs plus an isotropic remainder that keeps the trace:

    F ≈ F̃ = U diag(λ) Uᵀ + σ (I − U Uᵀ),   σ = (tr F − Σ λ) / (D − r)

``U`` ``(D, r)`` holds the r leading eigenvectors, ``λ`` ``(r,)`` their eigenvalues. F̃ shares F's
eigenvectors, so its relative Frobenius error is ``√(Σ_{i>r} (λ_i − σ)²) / ‖F‖_F`` from the
eigenvalues alone; :func:`truncate` takes the smallest r that meets a relative-error budget.

The ``precision`` metric (``COMPRESS_METRICS``) measures what a fusion method sees instead: the factor
enters a precision ``Λ = (s/T)·B ⊗ A + λ0 I`` whose eigenvalues are ``(s/T)·b_i·a_j + λ0``; replacing the
tail ``a_j`` by σ changes each by at most the relative amount ``|a_j − σ| / (a_j + f)`` with the floor
``f = λ0·T / (s·b_max)``. :func:`truncate` with ``floor`` keeps the smallest r whose worst such ratio is
within the budget, σ the level that minimises it (not the trace-keeping one): every eigenvalue of
the precision, hence every quadratic form, within that relative error per factor.
:class:`LowRankKron` is a Kronecker block held in that form (an artifact's ``kron_lowrank`` blocks,
written with ``--compress``).
"""

from __future__ import annotations

import torch

from posterior_fusion.curvature.base import Precision, eigh_psd
from posterior_fusion.curvature.kron import Kron

COMPRESS_METRICS = ("frobenius", "precision")


def truncate(F: torch.Tensor, budget: float,
             floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``(U (D, r), λ (r,), σ, error)`` of the smallest r whose low-rank-plus-isotropic approximation of
    the PSD ``F`` ``(D, D)`` has an error ≤ ``budget`` (r = D, σ = 0 and error 0 when no smaller rank
    does; all of F is then kept). ``floor`` None: the relative Frobenius error, σ keeping the trace;
    a floor ``f`` ≥ 0: the precision metric (module docstring), ``max_{i>r} |λ_i − σ| / (λ_i + f)``."""
    D = F.shape[0]
    lam, U = eigh_psd(F.double())
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


def rebuild(U: torch.Tensor, lam: torch.Tensor, sigma: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The factor ``U diag(λ) Uᵀ + σ (I − U Uᵀ)`` ``(D, D)`` in ``dtype`` (computed in float64)."""
    Ud, ld = U.double(), lam.double()
    F = (Ud * (ld - sigma)) @ Ud.T + sigma * torch.eye(U.shape[0], dtype=torch.float64)
    return (0.5 * (F + F.T)).to(dtype)


class LowRankKron(Kron):
    """A Kronecker block whose factors are each stored as ``F̃ = σ I + U diag(λ − σ) Uᵀ`` (top-r
    eigenpairs plus a trace-keeping isotropic remainder; :func:`truncate`). It is a :class:`Kron`:
    quadratic forms and log-determinants come from the compact form (``O(out·in·(r_B + r_A))``, no
    ``D × D`` factor), and a method that needs the plain factors gets them rebuilt on access
    (``.B``/``.A``, not kept). ``errors`` are each factor's recorded relative Frobenius error."""

    kind = "kron_lowrank"

    def __init__(self, UB: torch.Tensor, lB: torch.Tensor, sB: float, UA: torch.Tensor, lA: torch.Tensor, sA: float,
                 scale: float = 1.0, shift: float = 0.0, errors: tuple[float, float] = (0.0, 0.0)) -> None:
        Precision.__init__(self, scale, shift)
        self.UB, self.lB, self.sB = UB, lB, float(sB)
        self.UA, self.lA, self.sA = UA, lA, float(sA)
        self.errors = (float(errors[0]), float(errors[1]))

    @property
    def B(self) -> torch.Tensor:  # noqa: N802 - the Kron attribute it stands for
        return rebuild(self.UB, self.lB, self.sB, self.UB.dtype)

    @B.setter
    def B(self, value: torch.Tensor) -> None:  # noqa: N802
        raise AttributeError("a LowRankKron's factors are its compact form")

    @property
    def A(self) -> torch.Tensor:  # noqa: N802
        return rebuild(self.UA, self.lA, self.sA, self.UA.dtype)

    @A.setter
    def A(self, value: torch.Tensor) -> None:  # noqa: N802
        raise AttributeError("a LowRankKron's factors are its compact form")

    @property
    def shape(self) -> tuple[int, int]:
        return self.UB.shape[0], self.UA.shape[0]

    @property
    def dim(self) -> int:
        return self.UB.shape[0] * self.UA.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.UB.dtype

    def with_scale_shift(self, scale: float, shift: float) -> LowRankKron:
        return self._share_cache(LowRankKron(self.UB, self.lB, self.sB, self.UA, self.lA, self.sA, scale, shift,
                                             self.errors))

    def damped(self, n: float, d: float) -> LowRankKron:
        """Damping shifts every eigenvalue of a factor: the compact form stays compact."""
        return LowRankKron(self.UB, self.lB + n * d, self.sB + n * d, self.UA, self.lA + d, self.sA + d,
                           self.scale, self.shift, self.errors)

    def astype(self, dtype: torch.dtype) -> LowRankKron:
        return LowRankKron(self.UB.to(dtype), self.lB.to(dtype), self.sB, self.UA.to(dtype), self.lA.to(dtype),
                           self.sA, self.scale, self.shift, self.errors)

    def eigenvalues(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b (out,), a (in,))``: the kept eigenvalues, then σ repeated (no decomposition), or in the
        order of the eigenbases once :meth:`eigen` has built them (solve, whiten, sample)."""
        if self._eig is not None:
            return self._eig[0], self._eig[2]
        out, inn = self.shape
        b = torch.cat([self.lB, self.lB.new_full((out - self.lB.numel(),), self.sB)])
        a = torch.cat([self.lA, self.lA.new_full((inn - self.lA.numel(),), self.sA)])
        return b, a

    def quadratic_form(self, v: torch.Tensor) -> torch.Tensor:
        """``scale · ⟨V, B̃ V Ã⟩ + shift · ‖V‖²`` from the compact form: with ``P = U_Bᵀ V``,
        ``Q = V U_A``, ``R = U_Bᵀ V U_A`` and ``d = λ − σ``, ``⟨V, B̃ V Ã⟩ = σ_B σ_A ‖V‖² + σ_B Σ d_A ‖Q‖²
        + σ_A Σ d_B ‖P‖² + Σ d_B d_A R²``."""
        self._check_vec(v)
        V = v.reshape(*v.shape[:-1], *self.shape)
        dB, dA = self.lB - self.sB, self.lA - self.sA
        P = self.UB.T @ V
        Q = V @ self.UA
        R = P @ self.UA
        vv = V.square().sum((-2, -1))
        inner = (self.sB * self.sA * vv + self.sB * (Q.square() * dA).sum((-2, -1))
                 + self.sA * (P.square() * dB[:, None]).sum((-2, -1)) + (R.square() * dB[:, None] * dA).sum((-2, -1)))
        return self.scale * inner + self.shift * vv

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.UB, self.lB, self.UA, self.lA))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"lowrank_B_vectors": self.UB, "lowrank_B_values": self.lB,
                "lowrank_A_vectors": self.UA, "lowrank_A_values": self.lA}

    @classmethod
    def from_kron(cls, block: Kron, budget: float, prior: float | None = None) -> LowRankKron:
        """The compact form of a plain Kronecker block within a relative error ``budget`` per factor:
        Frobenius (``prior`` None) or in the precision metric for the precision ``(s/T)·B ⊗ A + λ0 I``
        with ``prior = λ0·T`` (module docstring; each factor's floor from the other's largest eigenvalue)."""
        floors = (None, None)
        if prior is not None:
            top_B, top_A = (float(torch.linalg.eigvalsh(f.double())[-1].clamp(min=0)) for f in (block.B, block.A))
            scale = float(block.scale)
            floors = (prior / (scale * top_A) if scale * top_A > 0 else float("inf"),
                      prior / (scale * top_B) if scale * top_B > 0 else float("inf"))
        UB, lB, sB, eB = truncate(block.B, budget, floors[0])
        UA, lA, sA, eA = truncate(block.A, budget, floors[1])
        return cls(UB, lB, sB, UA, lA, sA, block.scale, block.shift, (eB, eA))
