"""Exact solves of sums of Kronecker-factored precisions, one weight at a time: the operator

    X ↦ Σ_k w_k B_k X A_kᵀ + shift · X        (X (out, in); B_k (out, out), A_k (in, in) PSD)

is SPD (a weighted sum of Kronecker products of PSD factors, plus a shift) and is inverted by
conjugate gradients preconditioned with one Kronecker product, ``(B̄ + s_B I)⁻¹ · (Ā + s_A I)⁻¹``
(``B̄ = Σ w_k B_k``, ``Ā`` the w-weighted mean of the ``A_k``, ``s_A s_B = shift`` split in
proportion to the factors' mean eigenvalues), which is exact for a single term without a shift. (Taking
the shift exactly, ``(B̄ ⊗ Ā + shift · I)⁻¹`` through the factors' eigenbases, was tried: on ResNet-20
clients it took 4–6 % more iterations over all layers and 25–33 % more time,
``benchmarks/kron_preconditioner_bench.py``.) Used by FedLPA's aggregation, and through
:func:`solve_precision_sum` (a whole block-diagonal system, layer by layer) by the EM mode finder of
fedbens (``fusion/em.py``) and the exact solver of FedFisher and HBFL (``fusion/quadratic.py``).
"""

from __future__ import annotations

import math

import torch

from posterior_fusion.curvature import BlockDiag, Diag, Kron
from posterior_fusion.errors import IndefinitePrecisionError
from posterior_fusion.progress import progress
from posterior_fusion.runtime import release_freed_memory


def _indefinite(what: str, evidence: str) -> IndefinitePrecisionError:
    """The one error for a fused precision that is not positive definite: ``what`` it is, ``evidence`` why."""
    return IndefinitePrecisionError(
        f"{what} is not positive definite ({evidence}): the clients' curvature there spans more than float32 "
        f"resolves, or the prior is too weak for it; a client's curvature may be far out of scale with the "
        f"others' (`--robust` screens such clients)")


def _inverse(F: torch.Tensor) -> torch.Tensor:
    """Inverse of an SPD matrix ``(k, k)`` through its Cholesky factor."""
    return torch.cholesky_inverse(torch.linalg.cholesky(F))


def solve_kron_sum(Bs: list[torch.Tensor], As: list[torch.Tensor], w: torch.Tensor, rhs: torch.Tensor,
                   shift: float = 0.0, start: torch.Tensor | None = None, tolerance: float = 1e-10,
                   max_iterations: int = 1000, strict: bool = False) -> tuple[torch.Tensor, int, float]:
    """``X`` ``(out, in)`` with ``Σ_k w_k B_k X A_kᵀ + shift·X = rhs``; returns ``(X, iterations,
    relative residual)``. ``start``: the first iterate (default: the preconditioner applied to
    ``rhs``). Float64 arithmetic throughout, whatever the factors' dtype: each factor is converted where
    a product uses it, one term at a time, so float32 factors never exist as float64 all at once (for EM at
    C·M = 25 on a 2304-input layer, the copies of every term's ``A`` were 1 GB); ``tolerance`` is on
    ``‖residual‖ / ‖rhs‖``. ``strict``: a search direction of non-positive curvature (``pᵀ(op p) ≤ 0``: the
    operator is not positive definite) raises :class:`IndefinitePrecisionError` instead of iterating on
    (the caller's matrix is positive definite in exact arithmetic, so this is rounding or a bad input)."""
    f64 = torch.float64

    def op(X: torch.Tensor) -> torch.Tensor:
        out = sum(wk * (B.to(f64) @ X @ A.to(f64).T) for wk, B, A in zip(w, Bs, As))
        return out + shift * X if shift else out

    Bbar = sum(wk * B.to(f64) for wk, B in zip(w, Bs))
    Abar = sum(wk * A.to(f64) for wk, A in zip(w, As)) / float(sum(w))  # (Σ w B) ⊗ (mean A): exact for one term
    if shift > 0:  # a negative shift is left to the conjugate gradients (strict: reported below)
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
        curvature = (P * Q).sum()
        if strict and curvature <= 0:
            raise _indefinite(f"the fused Kronecker precision of a {rhs.shape[0]} × {rhs.shape[1]} weight",
                              f"a direction of curvature {float(curvature):.3g} after {it} conjugate-gradient steps")
        step = ry / curvature
        X, R = X + step * P, R - step * Q
        residual = float(R.norm()) / norm
        it += 1
        Y = precondition(R)
        ry, ry_old = (R * Y).sum(), ry
        P = Y + (ry / ry_old) * P
    return X, it, residual


def solve_precision_sum(terms: list[tuple[float, BlockDiag, torch.Tensor]], shift: float | list[float] = 0.0,
                        rhs: torch.Tensor | None = None, prior_scale: float = 0.0, prior_centre: torch.Tensor | None = None,
                        start: torch.Tensor | None = None, tolerance: float = 1e-10,
                        desc: str | None = None, strict: bool = False) -> tuple[torch.Tensor, dict]:
    """``w`` ``(d,)`` float64 solving, block by block (every ``P_k`` block-diagonal alike),

        (Σ_k r_k P_k + (shift + ε_j) I) w = Σ_k r_k P_k m_k + rhs + ε_j · prior_centre

    for ``terms`` = ``[(r_k, P_k, m_k (d,))]`` (``shift`` a number, or one per block), with
    ``ε_j = prior_scale × mean diag(Σ_k r_k P_k)`` over block ``j`` (a prior ``N(prior_centre, ε_j⁻¹ I)``
    per block, its precision relative to the block's curvature, pulling directions without curvature to
    ``prior_centre``; ``prior_centre`` is needed when ``prior_scale`` > 0). A Kronecker block by conjugate gradients (:func:`solve_kron_sum`, from
    ``start`` if given, to ``tolerance``), a diagonal one element-wise, any other through a dense
    Cholesky factor. Each block is converted to float64 where it is used, one at a time. ``desc``: show
    progress over the blocks under that name. ``strict``: a Kronecker system found not positive definite is an
    :class:`IndefinitePrecisionError` (as a dense one always is) rather than a slow, unconverged solve. Returns
    ``(w, info)`` with the conjugate gradients' total ``iterations`` and largest relative ``residual``."""
    ref = terms[0][1]
    f64 = torch.float64
    out = torch.empty(ref.dim, dtype=f64)
    info = {"iterations": 0, "residual": 0.0}
    shifts = [float(v) for v in shift] if isinstance(shift, (list, tuple)) else [float(shift)] * len(ref.blocks)
    for j, off in progress(enumerate(ref.offsets), desc or "", len(ref.offsets), show=desc is not None):
        shift_j = shifts[j]
        blocks = [(r, P.blocks[j], m[off: off + P.blocks[j].dim].double()) for r, P, m in terms]  # stored dtype
        dim = blocks[0][1].dim
        b = sum(r * blk.astype(f64).matvec(m) for r, blk, m in blocks)  # one float64 block at a time
        if rhs is not None:
            b = b + rhs[off: off + dim].double()
        eps = 0.0
        if prior_scale > 0:
            eps = prior_scale * float(sum(r * blk.diagonal().double().sum() for r, blk, _ in blocks)) / dim
            b = b + eps * prior_centre[off: off + dim].double()
        if all(isinstance(blk, Kron) for _, blk, _ in blocks):
            shape = blocks[0][1].shape
            w = torch.tensor([r * blk.scale for r, blk, _ in blocks], dtype=f64)
            total_shift = sum(r * blk.shift for r, blk, _ in blocks) + shift_j + eps
            first = None if start is None else start[off: off + dim].double().reshape(shape)
            try:
                X, it, res = solve_kron_sum([blk.B for _, blk, _ in blocks], [blk.A for _, blk, _ in blocks], w,
                                            b.reshape(shape), shift=total_shift, start=first, tolerance=tolerance,
                                            strict=strict)
            except IndefinitePrecisionError as err:
                raise IndefinitePrecisionError(f"curvature block {j}: {err}") from None
            out[off: off + dim] = X.reshape(-1)
            info["iterations"] += it
            info["residual"] = max(info["residual"], res)
        elif all(isinstance(blk, Diag) for _, blk, _ in blocks):
            out[off: off + dim] = b / (sum(r * blk.astype(f64).diagonal() for r, blk, _ in blocks) + shift_j + eps)
        else:
            H = sum(r * blk.astype(f64).to_dense() for r, blk, _ in blocks)
            H = H + (shift_j + eps) * torch.eye(dim, dtype=f64)
            L, bad = torch.linalg.cholesky_ex(H)
            if bad:
                ev = torch.linalg.eigvalsh(H)
                raise _indefinite(f"the fused precision of curvature block {j} ({dim} parameters)",
                                  f"eigenvalues from {float(ev[0]):.3g} to {float(ev[-1]):.3g}")
            out[off: off + dim] = torch.cholesky_solve(b[:, None], L)[:, 0]
        del blocks
        release_freed_memory()  # each layer's float64 copies differ in size: kept, they piled up to GBs
    return out, info
