"""Batched evaluation of stacked precision blocks: fusion's side of the curvature.

N components' blocks of one kind at one position are stacked so that the K points' quadratic
forms against all N come from a few batched products (with their vector-Jacobian product, for
the optimisers). The curvature classes (:mod:`posterior_fusion.curvature`) know the maths of one
precision; how N of them are evaluated together, in chunks bounded by a working-set size, and
the Kronecker low-rank shortcut live here. :data:`STACKERS` is the table per block kind (a new
block kind adds its class to ``BLOCK_TYPES`` and its stacker here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from posterior_fusion.curvature import Precision
from posterior_fusion.kernels import VJP, FormsWithVJP, kron_direct_forms_and_vjp, kron_quadratic_forms_and_vjp
from posterior_fusion.runtime import release_freed_memory


class StackedBlock(Protocol):
    """N blocks of one kind and size, stacked for batched evaluation (see ``fusion/gaussian_stack.py``).

    A frozen dataclass whose tensor fields (and tensors inside tuple fields) are all indexed by
    component first, so :func:`map_tensors` can move it or take a range of its components."""

    offset: int
    size: int
    logdets: torch.Tensor  # (N,) log|Λ_n|

    def quadratic_forms(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` ``(K, size)`` (this block's slice of K points) -> ``(K, N)`` quadratic forms,
        differentiable w.r.t. ``w`` (once)."""
        ...

    def forms_and_vjp(self, w: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """The same forms without an autograd graph, with their vector-Jacobian product:
        ``vjp(g (K, N)) -> (K, size)``, the gradient of ``Σ g ∘ q`` w.r.t. ``w``."""
        ...

    def to(self, device: str | torch.device) -> StackedBlock:
        ...


def map_tensors(block: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of the stacked block (a dataclass) with ``fn`` applied to every tensor field and to
    every tensor in a tuple field; other fields are kept."""

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value):
            return tuple(fn(t) for t in value)
        return value

    return dataclasses.replace(block, **{f.name: one(getattr(block, f.name)) for f in dataclasses.fields(block)})


def stack_diag(blocks: list[Precision], offset, mu, scales, shifts, dtype, spectral_cutoff=0.0, kernel=None) -> StackedDiag:
    """N diagonal blocks ``G_n`` as ``scale_n·G_n + shift_n`` with means ``mu`` ``(N, size)``."""
    S = scales[:, None] * torch.stack([b.g.to(dtype) for b in blocks]) + shifts[:, None]
    return StackedDiag(offset, mu.shape[1], mu, S, S.log().sum(1))


@dataclass(frozen=True)
class StackedDiag:
    """N diagonal blocks: means ``mu`` ``(N, size)``, precisions' diagonals ``S`` ``(N, size)``."""

    offset: int
    size: int
    mu: torch.Tensor
    S: torch.Tensor
    logdets: torch.Tensor

    def quadratic_forms(self, w: torch.Tensor) -> torch.Tensor:
        """``(K, N)``, differentiable w.r.t. ``w`` (see :meth:`forms_and_vjp`)."""
        return FormsWithVJP.apply(w, self.forms_and_vjp)

    def forms_and_vjp(self, w: torch.Tensor) -> tuple[torch.Tensor, VJP]:
        """``w`` ``(K, size)`` -> ``q[k, n] = Σ S_n (w_k − μ_n)²`` ``(K, N)`` and
        ``vjp(g (K, N)) = 2 Σ_n g[:, n] S_n (w − μ_n)`` ``(K, size)``; keeps ``S ∘ V`` ``(K, N, size)``."""
        V = w[:, None, :] - self.mu[None]
        SV = V * self.S[None]
        q = (V.mul_(SV)).sum(-1)
        return q, lambda g: 2 * torch.einsum("kn,kns->ks", g, SV)

    def to(self, device) -> StackedDiag:
        return map_tensors(self, lambda t: t.to(device))


def stack_dense(blocks: list[Precision], offset, mu, scales, shifts, dtype, spectral_cutoff=0.0, kernel=None) -> StackedDense:
    """N dense blocks in eigen-form with means ``mu`` ``(N, size)``."""
    eig = [b.eigen() for b in blocks]
    S = scales[:, None] * torch.stack([e[0].to(dtype) for e in eig]) + shifts[:, None]
    U = torch.stack([e[1].to(dtype) for e in eig])
    return StackedDense(offset, mu.shape[1], mu, S, U, S.log().sum(1))


@dataclass(frozen=True)
class StackedDense:
    """N dense blocks in eigen-form: ``mu`` ``(N, p)``, eigenvalues of Λ ``S`` ``(N, p)``, ``U`` ``(N, p, p)``."""

    offset: int
    size: int
    mu: torch.Tensor
    S: torch.Tensor
    U: torch.Tensor
    logdets: torch.Tensor

    def quadratic_forms(self, w: torch.Tensor) -> torch.Tensor:
        """``(K, N)``, differentiable w.r.t. ``w`` (see :meth:`forms_and_vjp`)."""
        return FormsWithVJP.apply(w, self.forms_and_vjp)

    def forms_and_vjp(self, w: torch.Tensor) -> tuple[torch.Tensor, VJP]:
        """``w`` ``(K, size)`` -> ``q[k, n] = Σ S_n z²`` with ``z = U_nᵀ (w_k − μ_n)`` ``(K, N)`` and
        ``vjp(g (K, N)) = 2 Σ_n g[:, n] U_n (S_n ∘ z)`` ``(K, size)``; keeps ``S ∘ z`` ``(K, N, p)``."""
        z = torch.einsum("knp,npq->knq", w[:, None, :] - self.mu[None], self.U)
        Sz = z * self.S[None]
        q = (z.mul_(Sz)).sum(-1)
        return q, lambda g: 2 * torch.einsum("kn,knq,npq->kp", g, Sz, self.U)

    def to(self, device) -> StackedDense:
        return map_tensors(self, lambda t: t.to(device))


def _adopted(blocks: list[Precision], name: str, dtype: torch.dtype) -> torch.Tensor:
    """The factors ``name`` of N Kronecker blocks stacked ``(N, D, D)``; where they already have the
    stack's dtype, each block holds its factor in a view of the stack (:meth:`Kron.share_storage`: the same
    values, checked), so the factors are held once, not twice (the server's peak memory at real size: ``docs/benchmarks.md``)."""
    stacked = torch.stack([getattr(blk, name).to(dtype) for blk in blocks])
    if all(getattr(blk, name).dtype == dtype and getattr(blk, name).device == stacked.device for blk in blocks):
        for n, blk in enumerate(blocks):
            blk.share_storage(name, stacked[n])
        # the originals are freed: their pages go back to the system now (under pfuse's allocator setting they
        # would stay resident), so stacking peaks at one layer's stack over the loaded artifacts
        release_freed_memory()
    return stacked


def stack_kron(blocks: list[Precision], offset, mu, scales, shifts, dtype, spectral_cutoff=0.0, kernel=None,
               rotated: bool = False) -> StackedKron:
    """Eigen-bases sorted ascending per component; with ``spectral_cutoff > 0`` the low-rank
    shortcut of ``fusion/gaussian_stack.py`` keeps only directions with curvature ``>= tol · shift``.
    Without it only the direct form's factors are kept (``rotated=True`` also keeps the stacked
    eigenbases for the rotated form: twice the memory, ``docs/benchmarks.md`` "Server at real size")."""
    out, inn = blocks[0].shape
    if spectral_cutoff <= 0 and not rotated:  # the direct form: the factors and their eigenvalues only
        b = torch.stack([blk.eigenvalues()[0].to(dtype) for blk in blocks])  # (N, out)
        a = torch.stack([blk.eigenvalues()[1].to(dtype) for blk in blocks])  # (N, in)
        logdets = (scales[:, None, None] * b[:, :, None] * a[:, None, :] + shifts[:, None, None]).log().flatten(1).sum(1)
        Bs = _adopted([blk for blk in blocks], "B", dtype)
        As = _adopted([blk for blk in blocks], "A", dtype)
        mu = mu.reshape(-1, out, inn).to(dtype)
        direct = (Bs, As, Bs @ mu, scales.to(dtype).clone(), shifts.to(dtype).clone(), mu.flatten(1).square().sum(1))
        return StackedKron(offset, out * inn, mu, None, None, None, logdets, None, (out, inn, out, inn), kernel, direct)
    eig = [b.eigen() for b in blocks]
    b = torch.stack([e[0].to(dtype) for e in eig])  # (N, out)
    a = torch.stack([e[2].to(dtype) for e in eig])  # (N, in)
    UB = torch.stack([e[1].to(dtype) for e in eig])
    UA = torch.stack([e[3].to(dtype) for e in eig])
    # Ascending order per component, whatever order the decomposition came in.
    b, ib = b.sort(dim=1)
    a, ia = a.sort(dim=1)
    UB = UB.gather(2, ib[:, None, :].expand_as(UB))
    UA = UA.gather(2, ia[:, None, :].expand_as(UA))
    curv = scales[:, None, None] * b[:, :, None] * a[:, None, :]  # (N, out, in)
    logdets = (curv + shifts[:, None, None]).log().flatten(1).sum(1)
    mu = mu.reshape(-1, out, inn)
    if spectral_cutoff <= 0:  # both forms (rotated=True): the raw factors rebuilt from the clamped spectra
        Bs = (UB * b[:, None, :]) @ UB.transpose(1, 2)
        As = (UA * a[:, None, :]) @ UA.transpose(1, 2)
        mu = mu.to(dtype)
        direct = (Bs, As, Bs @ mu, scales.to(dtype).clone(), shifts.to(dtype).clone(), mu.flatten(1).square().sum(1))
        return StackedKron(offset, out * inn, mu, curv + shifts[:, None, None], UB, UA, logdets, None,
                           (out, inn, out, inn), kernel, direct)
    thresh = spectral_cutoff * shifts
    keep_b = int((scales[:, None] * b * a[:, -1:] >= thresh[:, None]).sum(1).max().clamp_min(1).item())
    keep_a = int((scales[:, None] * a * b[:, -1:] >= thresh[:, None]).sum(1).max().clamp_min(1).item())
    return StackedKron(offset, out * inn, mu, curv[:, -keep_b:, -keep_a:].contiguous(),
                       UB[:, :, -keep_b:].contiguous(), UA[:, :, -keep_a:].contiguous(), logdets,
                       shifts.clone(), (out, inn, keep_b, keep_a), kernel)


CHUNK_BYTES = 64 * 2**20  # working-set bound of the batched Kronecker quadratic forms (CPU)
# On a GPU each chunk costs a dozen kernel launches per block whatever its size, and memory is not
# the limit: larger chunks (measured on an H100, docs/benchmarks.md "On a GPU").
CUDA_CHUNK_BYTES = 2**30


def default_chunk_bytes(device: torch.device | str) -> int:
    """The working-set bound for tensors on ``device``: :data:`CUDA_CHUNK_BYTES` on CUDA, else :data:`CHUNK_BYTES`."""
    return CUDA_CHUNK_BYTES if torch.device(device).type == "cuda" else CHUNK_BYTES


@dataclass(frozen=True)
class StackedKron:
    """N Kronecker blocks: ``mu`` ``(N, out, in)``, rotated weights ``S`` ``(N, R1, R2)``,
    bases ``UB`` ``(N, out, R1)`` / ``UA`` ``(N, in, R2)``; ``shift`` ``(N,)`` only under the
    low-rank shortcut (its closed-form ``shift ‖W − μ‖²`` term); ``rank`` = (out, in, R1, R2).
    ``direct`` = ``(B (N, out, out), A (N, in, in), B μ, scales (N,), shifts (N,), ‖μ‖² (N,))``: the raw
    factors for the direct form (torch backend, no low-rank shortcut)."""

    offset: int
    size: int
    mu: torch.Tensor
    S: torch.Tensor | None  # None: the direct form alone
    UB: torch.Tensor | None
    UA: torch.Tensor | None
    logdets: torch.Tensor
    shift: torch.Tensor | None
    rank: tuple[int, int, int, int]
    kernel: str | None = None
    direct: tuple[torch.Tensor, ...] | None = None

    def quadratic_forms(self, w: torch.Tensor, chunk_bytes: int | None = None, form: str | None = None) -> torch.Tensor:
        """``(K, N)``, differentiable w.r.t. ``w`` (see :meth:`forms_and_vjp`)."""
        return FormsWithVJP.apply(w, self.forms_and_vjp, chunk_bytes, form)

    def forms_and_vjp(self, w: torch.Tensor, chunk_bytes: int | None = None,
                      form: str | None = None) -> tuple[torch.Tensor, VJP]:
        """``w`` ``(K, size)`` -> ``q`` ``(K, N)`` and ``vjp(grad_q (K, N)) -> (K, size)``.

        Components are processed in chunks whose ``(K, n, R1, R2)`` temporaries stay under
        ``chunk_bytes`` (default :func:`default_chunk_bytes` of ``w``'s device), so memory does not grow with N.
        ``form``: ``"direct"`` (raw factors; the default when available) or ``"rotated"``
        (eigenbases; the low-rank shortcut)."""
        K = w.shape[0]
        Wk = w.reshape(K, *self.mu.shape[1:])
        N = self.mu.shape[0]
        R1, R2 = self.rank[2:]
        per = max(1, K * R1 * R2 * Wk.element_size() * 3)
        step = max(1, min(N, (default_chunk_bytes(w.device) if chunk_bytes is None else chunk_bytes) // per))
        if form is None:
            form = "direct" if self.direct is not None else "rotated"
        # component ranges of the chunks; one chunk uses the stacked tensors as they are (no slicing:
        # this runs every optimiser step)
        spans = [(i, min(i + step, N)) for i in range(0, N, step)]

        def take(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return t if (a, b) == (0, N) else t[a:b]

        if form == "direct":
            if self.direct is None:
                raise ValueError("the direct form needs the raw factors (not under the low-rank shortcut)")
            parts = [kron_direct_forms_and_vjp(Wk, take(self.mu, a, b), *(take(t, a, b) for t in self.direct[:-1]),
                                               self.kernel, take(self.direct[-1], a, b))
                     for a, b in spans]
        else:
            if self.S is None:
                raise ValueError("the rotated form needs the stacked eigenbases (stack_kron(..., rotated=True))")
            parts = [kron_quadratic_forms_and_vjp(Wk, *(take(t, a, b) for t in (self.mu, self.UB, self.UA, self.S)),
                                                  self.kernel)
                     for a, b in spans]
        if len(parts) == 1:
            return self._with_shift(w, *parts[0], K)
        q = torch.cat([p[0] for p in parts], dim=1)

        def chunked_vjp(g: torch.Tensor) -> torch.Tensor:
            grads = (vj(g[:, a:b].contiguous()) for (a, b), (_, vj) in zip(spans, parts))
            grad = next(grads)  # a fresh tensor: accumulated in place
            for other in grads:
                grad += other
            return grad

        return self._with_shift(w, q, chunked_vjp, K)

    def _with_shift(self, w: torch.Tensor, q: torch.Tensor, vjp: VJP, K: int) -> tuple[torch.Tensor, VJP]:
        """``(q, vjp)`` of the blocks' products, reshaped to ``(K, size)`` gradients, plus the low-rank
        shortcut's closed-form ``λ0 ‖W − μ‖²`` term when it is on."""
        if self.shift is None:
            return q, lambda g: vjp(g).reshape(K, -1)
        flat_mu = self.mu.flatten(1)  # closed-form λ0 ‖W − μ‖² of the low-rank shortcut
        q = q + self.shift[None] * (w.square().sum(1)[:, None] - 2 * w @ flat_mu.T + flat_mu.square().sum(1)[None])

        def shifted_vjp(g: torch.Tensor) -> torch.Tensor:
            gl = g * self.shift[None]  # + 2 Σ_n g λ (w − μ_n)
            return vjp(g).reshape(K, -1) + 2 * (gl.sum(1, keepdim=True) * w - gl @ flat_mu)

        return q, shifted_vjp

    def to(self, device) -> StackedKron:
        return map_tensors(self, lambda t: t.to(device))


def _padded(U: torch.Tensor, lam: torch.Tensor, sigma: float, r: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``U`` ``(D, r)`` and ``d = λ − σ`` ``(r,)`` padded with zero columns to ``r`` (they add nothing)."""
    Up = torch.zeros(U.shape[0], r, dtype=dtype)
    Up[:, : U.shape[1]] = U.to(dtype)
    d = torch.zeros(r, dtype=dtype)
    d[: lam.numel()] = (lam.double() - sigma).clamp_min(0).to(dtype)
    return Up, d


def stack_lowrank_kron(blocks: list[Precision], offset, mu, scales, shifts, dtype, spectral_cutoff=0.0,
                       kernel=None) -> StackedCompressedKron:
    """N compressed Kronecker blocks (:class:`~posterior_fusion.curvature.CompressedKron`) in their
    compact form, ranks padded to the largest of the N (zero columns)."""
    out, inn = blocks[0].shape
    rB = max(b.lB.numel() for b in blocks)
    rA = max(b.lA.numel() for b in blocks)
    sideB = [_padded(b.UB, b.lB, b.sB, rB, dtype) for b in blocks]
    sideA = [_padded(b.UA, b.lA, b.sA, rA, dtype) for b in blocks]
    logdets = torch.stack([
        (float(s) * torch.outer(*(t.double() for t in b.eigenvalues())) + float(h)).log().sum()
        for b, s, h in zip(blocks, scales, shifts)]).to(dtype)
    return StackedCompressedKron(
        offset, out * inn, mu.reshape(-1, out, inn).to(dtype),
        torch.stack([u for u, _ in sideB]), torch.stack([d for _, d in sideB]),
        torch.tensor([b.sB for b in blocks], dtype=dtype),
        torch.stack([u for u, _ in sideA]), torch.stack([d for _, d in sideA]),
        torch.tensor([b.sA for b in blocks], dtype=dtype),
        scales.to(dtype).clone(), shifts.to(dtype).clone(), logdets, (out, inn, rB, rA))


@dataclass(frozen=True)
class StackedCompressedKron:
    """N Kronecker blocks in compact form, ``F = σ I + U diag(d) Uᵀ`` per factor: ``mu`` ``(N, out, in)``,
    ``UB`` ``(N, out, r_B)``, ``dB`` ``(N, r_B)``, ``sB`` ``(N,)`` and the same for A; precisions
    ``scale_n (B ⊗ A) + shift_n I``. A quadratic form costs ``O(out·in·(r_B + r_A))`` per point and
    component: no ``D × D`` factor is formed."""

    offset: int
    size: int
    mu: torch.Tensor
    UB: torch.Tensor
    dB: torch.Tensor
    sB: torch.Tensor
    UA: torch.Tensor
    dA: torch.Tensor
    sA: torch.Tensor
    scales: torch.Tensor
    shifts: torch.Tensor
    logdets: torch.Tensor
    rank: tuple[int, int, int, int]

    def quadratic_forms(self, w: torch.Tensor, chunk_bytes: int | None = None) -> torch.Tensor:
        """``(K, N)``, differentiable w.r.t. ``w`` (see :meth:`forms_and_vjp`)."""
        return FormsWithVJP.apply(w, self.forms_and_vjp, chunk_bytes)

    def forms_and_vjp(self, w: torch.Tensor, chunk_bytes: int | None = None) -> tuple[torch.Tensor, VJP]:
        """``w`` ``(K, size)`` -> ``q`` ``(K, N)`` and ``vjp(g (K, N)) -> (K, size)``. With
        ``V = W_k − μ_n``, ``P = U_Bᵀ V``, ``Q = V U_A``, ``R = U_Bᵀ V U_A``:
        ``q = scale (σ_B σ_A ‖V‖² + σ_B Σ d_A ‖Q‖² + σ_A Σ d_B ‖P‖² + Σ d_B d_A R²) + shift ‖V‖²`` and
        ``∂q/∂V = 2 [(scale σ_B σ_A + shift) V + scale σ_B Q d_A U_Aᵀ + scale σ_A U_B d_B P + scale U_B d_B R d_A U_Aᵀ]``.
        Components are processed in chunks whose ``(K, n, out, in)`` differences stay under ``chunk_bytes``."""
        K = w.shape[0]
        out, inn = self.mu.shape[1:]
        Wk = w.reshape(K, out, inn)
        N = self.mu.shape[0]
        per = max(1, K * out * inn * Wk.element_size() * 2)
        step = max(1, min(N, (default_chunk_bytes(w.device) if chunk_bytes is None else chunk_bytes) // per))
        parts = [self._span(Wk, a, min(a + step, N)) for a in range(0, N, step)]
        q = torch.cat([p[0] for p in parts], dim=1)
        bounds = [(a, min(a + step, N)) for a in range(0, N, step)]

        def vjp(g: torch.Tensor) -> torch.Tensor:
            grad = sum(vj(g[:, a:b]) for (a, b), (_, vj) in zip(bounds, parts))
            return grad.reshape(K, -1)

        return q, vjp

    def _span(self, Wk: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, VJP]:
        UB, dB, sB, UA, dA, sA = (t[a:b] for t in (self.UB, self.dB, self.sB, self.UA, self.dA, self.sA))
        scale, shift = self.scales[a:b], self.shifts[a:b]
        V = Wk[:, None] - self.mu[None, a:b]                       # (K, n, out, in)
        P = torch.einsum("nor,knoi->knri", UB, V)                  # (K, n, rB, in)
        Q = torch.einsum("knoi,nij->knoj", V, UA)                  # (K, n, out, rA)
        R = torch.einsum("knri,nij->knrj", P, UA)                  # (K, n, rB, rA)
        vv = V.square().sum((-2, -1))
        inner = (sB * sA * vv + sB * (Q.square() * dA[None, :, None, :]).sum((-2, -1))
                 + sA * (P.square() * dB[None, :, :, None]).sum((-2, -1))
                 + (R.square() * dB[None, :, :, None] * dA[None, :, None, :]).sum((-2, -1)))
        q = scale * inner + shift * vv

        def vjp(g: torch.Tensor) -> torch.Tensor:
            out = torch.einsum("kn,knoi->koi", g * (scale * sB * sA + shift), V)
            out += torch.einsum("kn,knoj,nij->koi", g * scale * sB, Q * dA[None, :, None, :], UA)
            out += torch.einsum("kn,nor,knri->koi", g * scale * sA, UB, P * dB[None, :, :, None])
            out += torch.einsum("kn,nor,knrj,nij->koi", g * scale, UB,
                                R * dB[None, :, :, None] * dA[None, :, None, :], UA)
            return 2 * out

        return q, vjp

    def to(self, device) -> StackedCompressedKron:
        return map_tensors(self, lambda t: t.to(device))


Stacker = Callable[..., Any]
# block kind -> stacker(blocks, offset, mu (N, size), scales (N,), shifts (N,), dtype, spectral_cutoff, kernel)
STACKERS: dict[str, Stacker] = {"diag": stack_diag, "dense": stack_dense, "kron": stack_kron,
                                "kron_lowrank": stack_lowrank_kron}
