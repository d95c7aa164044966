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
:class:`CompressedKron` is a Kronecker block held in that form (an artifact's ``kron_lowrank`` blocks,
written with ``--compress``).

``vectors = "float16"`` (:class:`Compression`) stores the trailing kept eigenvectors in half precision
(:func:`split_half`): rounding an eigenvector of a large eigenvalue leaks that eigenvalue into directions
where the precision is small, so the leading k stay float32 — the smallest k whose stored form is within
the budget and whose rounding alone costs at most :data:`ROUNDING_SHARE` of it, the truncation taking
:data:`HALF_SHARE`. The reader makes the joined vectors orthonormal
again (:func:`orthonormalise`, the nearest orthonormal basis) and the writer records the error of exactly
that form (:func:`stored_error`, dense, in the same metric); a factor stays wholly float32 where that is
not smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posterior_fusion.choices import COMPRESS_METRICS, VECTOR_DTYPES
from posterior_fusion.curvature.base import Precision
from posterior_fusion.curvature.kron import Kron
from posterior_fusion.curvature.truncation import (
    factor_eigh,
    joined,
    rebuild,
    split_half,
    truncate,
)
from posterior_fusion.errors import ConfigError


@dataclass(frozen=True)
class Compression:
    """How an artifact's Kronecker factors are written: ``budget`` (relative error per factor; 0:
    plain, exact), the ``metric`` it bounds (:data:`COMPRESS_METRICS`) and the storage type of the kept
    eigenvectors (``vectors``, :data:`VECTOR_DTYPES`). The fields are ``FitConfig``'s ``compress``,
    ``compress_metric`` and ``compress_vectors``."""

    budget: float = 0.0
    metric: str = "precision"
    vectors: str = "float32"

    def validate(self) -> None:
        """One :class:`~posterior_fusion.errors.ConfigError` line per bad field, named as the settings are."""
        if self.metric not in COMPRESS_METRICS:
            raise ConfigError(f"unknown `compress_metric` {self.metric!r}; use one of {', '.join(COMPRESS_METRICS)}")
        if self.vectors not in VECTOR_DTYPES:
            raise ConfigError(f"unknown `compress_vectors` {self.vectors!r}; use one of {', '.join(VECTOR_DTYPES)}")
        if not 0 <= self.budget < 1:
            raise ConfigError(f"`compress` must be in [0, 1) (a relative error budget; 0: plain), got {self.budget}")

    @property
    def half(self) -> bool:
        return self.budget > 0 and self.vectors == "float16"


PLAIN = Compression()






def precision_errors(block: CompressedKron, prior: float, metric: str) -> tuple[float, float]:
    """Per factor ``(B, A)``, the error in the precision metric (module docstring) of the precision
    ``(s/T)·B ⊗ A + λ0 I`` that fusion sees, ``prior = λ0·T``: each precision eigenvalue then lies within
    about ``×[(1 − e_B)(1 − e_A), (1 + e_B)(1 + e_A)]`` of the uncompressed one's. ``metric = "precision"``:
    the recorded errors, which are exactly that. ``"frobenius"``: an upper bound from the compact form
    alone — every tail eigenvalue has ``|λ_i − σ| ≤ e·‖F‖_F`` and ``λ_i + f ≥ f``, so the ratio is at most
    ``e·‖F‖_F / f``; ``‖F‖_F ≤ √(Σ λ_kept² + ((D − r)·σ)²)`` (the tail is ≥ 0 and sums to ``(D − r)·σ``), and
    the other factor's largest eigenvalue, which sets ``f``, at most its kept top (or ``D·σ`` where
    nothing is kept)."""
    if metric == "precision":
        return block.errors
    def norm_and_top(lam: torch.Tensor, sigma: float, D: int) -> tuple[float, float]:
        kept = lam.double()
        norm = (float(kept.square().sum()) + ((D - kept.numel()) * sigma) ** 2) ** 0.5
        top = float(kept.max()) if kept.numel() else D * sigma
        return norm, max(top, sigma)
    (out, inn), s = block.shape, abs(float(block.scale))
    norm_B, top_B = norm_and_top(block.lB, block.sB, out)
    norm_A, top_A = norm_and_top(block.lA, block.sA, inn)
    bounds = []
    for err, norm, top_other in ((block.errors[0], norm_B, top_A), (block.errors[1], norm_A, top_B)):
        if err == 0.0:
            bounds.append(0.0)
            continue
        floor = prior / (s * top_other) if s * top_other > 0 else float("inf")
        bounds.append(err * norm / floor if floor > 0 else float("inf"))
    return bounds[0], bounds[1]


class CompressedKron(Kron):
    """A Kronecker block whose factors are each stored as ``F̃ = σ I + U diag(λ − σ) Uᵀ`` (top-r
    eigenpairs plus an isotropic remainder; :func:`truncate`). It is a :class:`Kron` that overrides
    every operation: quadratic forms, products, solves, whitening, draws, diagonals and
    log-determinants come from the compact form (``O(out·in·(r_B + r_A))``, no ``D × D`` factor).
    Three things form dense matrices, by what they are: ``.B``/``.A`` (the rebuilt factors, not kept),
    :meth:`eigen` (whole eigenbases) and :meth:`to_dense`. ``errors`` are each factor's recorded error; ``stored`` holds, per factor,
    the eigenvectors as written where part of them is float16 — ``(lead (D, k), tail (D, h) float16)``,
    whose :func:`joined` form ``UB``/``UA`` are — or None (written as ``UB``/``UA``)."""

    kind = "kron_lowrank"

    def __init__(self, UB: torch.Tensor, lB: torch.Tensor, sB: float, UA: torch.Tensor, lA: torch.Tensor, sA: float,
                 scale: float = 1.0, shift: float = 0.0, errors: tuple[float, float] = (0.0, 0.0),
                 stored: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] = (None, None)) -> None:
        Precision.__init__(self, scale, shift)
        self.UB, self.lB, self.sB = UB, lB, float(sB)
        self.UA, self.lA, self.sA = UA, lA, float(sA)
        self.errors = (float(errors[0]), float(errors[1]))
        self.stored = stored

    @property
    def B(self) -> torch.Tensor:  # noqa: N802 - the Kron attribute it stands for
        return rebuild(self.UB, self.lB, self.sB, self.UB.dtype)

    @B.setter
    def B(self, value: torch.Tensor) -> None:  # noqa: N802
        raise AttributeError("a CompressedKron's factors are its compact form")

    @property
    def A(self) -> torch.Tensor:  # noqa: N802
        return rebuild(self.UA, self.lA, self.sA, self.UA.dtype)

    @A.setter
    def A(self, value: torch.Tensor) -> None:  # noqa: N802
        raise AttributeError("a CompressedKron's factors are its compact form")

    @property
    def shape(self) -> tuple[int, int]:
        return self.UB.shape[0], self.UA.shape[0]

    @property
    def dim(self) -> int:
        return self.UB.shape[0] * self.UA.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.UB.dtype

    def with_scale_shift(self, scale: float, shift: float) -> CompressedKron:
        return self._share_cache(CompressedKron(self.UB, self.lB, self.sB, self.UA, self.lA, self.sA, scale, shift,
                                             self.errors, self.stored))

    def damped(self, n: float, d: float) -> CompressedKron:
        """Damping shifts every eigenvalue of a factor: the compact form stays compact."""
        return CompressedKron(self.UB, self.lB + n * d, self.sB + n * d, self.UA, self.lA + d, self.sA + d,
                           self.scale, self.shift, self.errors, self.stored)

    def astype(self, dtype: torch.dtype) -> CompressedKron:
        return CompressedKron(self.UB.to(dtype), self.lB.to(dtype), self.sB, self.UA.to(dtype), self.lA.to(dtype),
                           self.sA, self.scale, self.shift, self.errors, self.stored)

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

    def _apply(self, v: torch.Tensor, fn) -> torch.Tensor:
        """``fn(Λ) v`` for ``v`` ``(..., dim)`` from the compact form, ``fn`` applied to Λ's eigenvalues
        ``scale·b a + shift``. ``V`` splits into the four parts the factors' kept spaces and their
        complements span (``P_B V P_A``, ``P_B V (I − P_A)``, …); on each, Λ's eigenvalue is ``b_i a_j``,
        ``b_i σ_A``, ``σ_B a_j`` or ``σ_B σ_A`` (scaled and shifted): ``O(out·in·(r_B + r_A))``, no
        ``D × D`` factor."""
        self._check_vec(v)
        V = v.reshape(*v.shape[:-1], *self.shape)
        UB, UA = self.UB.to(V.dtype), self.UA.to(V.dtype)
        lB, lA = self.lB.to(V.dtype), self.lA.to(V.dtype)
        sB, sA = torch.tensor(self.sB, dtype=V.dtype), torch.tensor(self.sA, dtype=V.dtype)

        def f(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            return fn(self.scale * b * a + self.shift)

        P = UB.T @ V                          # (..., r_B, in)
        Z11 = P @ UA                          # (..., r_B, r_A)
        VA = V @ UA                           # (..., out, r_A)
        Z12 = P - Z11 @ UA.T                  # U_Bᵀ V (I − P_A)
        Z21 = VA - UB @ Z11                   # (I − P_B) V U_A
        R22 = V - UB @ P - Z21 @ UA.T         # (I − P_B) V (I − P_A)
        out = (UB @ ((f(lB[:, None], lA[None, :]) * Z11) @ UA.T + f(lB, sA)[:, None] * Z12)
               + (Z21 * f(sB, lA)) @ UA.T + f(sB, sA) * R22)
        return out.reshape(v.shape)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self._apply(v, lambda e: e)

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        return self._apply(v, torch.reciprocal)

    def whiten(self, v: torch.Tensor) -> torch.Tensor:
        """``Λ^{-1/2} v`` (the symmetric root: ``u uᵀ = W Λ⁻¹ Wᵀ`` as for every block)."""
        return self._apply(v, torch.rsqrt)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        eps = torch.randn(n, self.dim, generator=generator, dtype=self.dtype)
        return self._apply(eps, torch.rsqrt)

    def diagonal(self) -> torch.Tensor:
        """``scale · diag(B̃) ⊗ diag(Ã) + shift`` with ``diag(F̃)_i = σ + Σ_k (λ_k − σ) U_ik²``."""
        dB = self.sB + (self.UB.square() * (self.lB - self.sB)).sum(1)
        dA = self.sA + (self.UA.square() * (self.lA - self.sA)).sum(1)
        return (self.scale * torch.outer(dB, dA) + self.shift).reshape(-1)

    def eigen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full factor eigenpairs ``(b, U_B (out, out), a, U_A (in, in))``: the kept eigenvectors completed
        by an orthonormal basis of their complement (eigenvalue σ). This is the one operation that forms
        ``D × D`` matrices (a caller that needs a whole eigenbasis: the stacked Kronecker evaluation)."""
        if self._eig is None:
            parts = []
            for U, lam, sigma in ((self.UB, self.lB, self.sB), (self.UA, self.lA, self.sA)):
                D, r = U.shape
                Q, _ = torch.linalg.qr(torch.cat([U.double(), torch.eye(D, dtype=torch.float64)], 1))
                basis = torch.cat([U.double(), Q[:, r:D]], 1).to(U.dtype)
                values = torch.cat([lam, lam.new_full((D - r,), sigma)]).clamp_min(0)
                parts += [values, basis]
            self._eig = tuple(parts)
        return self._eig

    def to_dense(self) -> torch.Tensor:
        return self.scale * torch.kron(self.B, self.A) + self.shift * torch.eye(self.dim, dtype=self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.UB, self.lB, self.UA, self.lA))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The datasets as written: a factor whose trailing eigenvectors are float16 has them in
        ``lowrank_*_half_vectors`` and its leading ones in ``lowrank_*_vectors``."""
        out = {}
        for side, U, lam, stored in (("B", self.UB, self.lB, self.stored[0]), ("A", self.UA, self.lA, self.stored[1])):
            out[f"lowrank_{side}_vectors"] = U if stored is None else stored[0]
            out[f"lowrank_{side}_values"] = lam
            if stored is not None:
                out[f"lowrank_{side}_half_vectors"] = stored[1]
        return out

    @property
    def half_counts(self) -> tuple[int, int]:
        """Per factor, how many kept eigenvectors are stored as float16."""
        return tuple(0 if s is None else s[1].shape[1] for s in self.stored)

    @classmethod
    def from_kron(cls, block: Kron, budget: float, prior: float | None = None, half: bool = False) -> CompressedKron:
        """The compact form of a plain Kronecker block within a relative error ``budget`` per factor:
        Frobenius (``prior`` None) or in the precision metric for the precision ``(s/T)·B ⊗ A + λ0 I``
        with ``prior = λ0·T`` (module docstring; each factor's floor from the other's largest eigenvalue).
        ``half``: per factor, the trailing kept eigenvectors as float16 (:func:`split_half`) where that
        takes fewer bytes than all in float32 at the full budget; the recorded error is the stored form's."""
        floors = (None, None)
        if prior is not None:
            top_B, top_A = (float(torch.linalg.eigvalsh(f.double())[-1].clamp(min=0)) for f in (block.B, block.A))
            scale = float(block.scale)
            floors = (prior / (scale * top_A) if scale * top_A > 0 else float("inf"),
                      prior / (scale * top_B) if scale * top_B > 0 else float("inf"))
        parts, errors, stored = [], [], []
        for F, floor in ((block.B, floors[0]), (block.A, floors[1])):
            eig = factor_eigh(F)  # one decomposition per factor, shared by both truncations and the split
            U, lam, sigma, err = truncate(F, budget, floor, eig)
            kept = None
            split = split_half(F, budget, floor, eig) if half and U.shape[1] > 0 else None
            if split is not None:
                lead, tail, lam_s, sigma_s, err_s = split
                if lead.numel() * lead.element_size() + tail.numel() * 2 < U.numel() * U.element_size():
                    U, lam, sigma, err, kept = joined(lead, tail).to(F.dtype), lam_s, sigma_s, err_s, (lead, tail)
            parts += [U, lam, sigma]
            errors.append(err)
            stored.append(kept)
        return cls(*parts, block.scale, block.shift, tuple(errors), tuple(stored))
