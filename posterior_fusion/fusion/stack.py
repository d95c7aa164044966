"""Stacked Gaussian components for fast evaluation of many quadratic forms at once.

Low-rank shortcut (``lowrank_tol > 0``, Kronecker blocks): eigen-directions whose curvature
``scale · b_i a_j`` is below ``lowrank_tol · shift`` for every partner direction are dropped
from the rotation and their ``shift ‖·‖²`` contribution is added in closed form, so
``shift ‖V‖²`` is exact and the dropped curvature is at most ``lowrank_tol · shift ‖V‖²
<= lowrank_tol · q``: the relative error of every quadratic form is below ``lowrank_tol``.
Log-determinants always use the full spectra.

``StackedGaussians`` holds N components ``N(μ_n, Λ_n⁻¹)`` that share one block structure
(the curvature blocks of a set of client components) and evaluates, for K points ``W``
``(K, d)``, every quadratic form ``(w_k − μ_n)ᵀ Λ_n (w_k − μ_n)`` as a ``(K, N)`` tensor
in one batched pass per block, plus each ``log|Λ_n|``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posterior_fusion.artifact.objects import Component
from posterior_fusion.curvature import Dense, Diag, Kron
from posterior_fusion.errors import IncompatibleArtifactsError
from posterior_fusion.kernels import kron_quadratic_forms


@dataclass(frozen=True)
class _Block:
    kind: str               # "diag" | "dense" | "kron"
    offset: int
    size: int
    mu: torch.Tensor        # (N, size) or (N, out, in) for kron
    S: torch.Tensor         # eigenvalues of Λ: (N, size) or (N, out, in)
    U: torch.Tensor | None  # dense: (N, size, size); kron: U_B (N, out, out)
    UA: torch.Tensor | None  # kron: U_A (N, in, in)
    shift: torch.Tensor | None = None  # low-rank kron: λ0 per component for the closed-form term


class StackedGaussians:
    """N components with precisions ``scale_n·G_n + shift_n·I`` stacked block by block.

    ``scale`` and ``shift`` are one float for all components or one per component.
    """

    def __init__(self, components: list[Component], scale: float | list[float], shift: float | list[float],
                 dtype: torch.dtype = torch.float32, lowrank_tol: float = 0.0, backend: str | None = None) -> None:
        if not components:
            raise IncompatibleArtifactsError("no components to stack")
        ref = components[0].curvature
        signature = [(type(b).__name__, b.dim) for b in ref.blocks]
        for c in components[1:]:
            if [(type(b).__name__, b.dim) for b in c.curvature.blocks] != signature:
                raise IncompatibleArtifactsError("components have different curvature block structures")
        self.num = len(components)
        scales = torch.as_tensor(scale if isinstance(scale, list) else [scale] * self.num, dtype=dtype)
        shifts = torch.as_tensor(shift if isinstance(shift, list) else [shift] * self.num, dtype=dtype)
        self.dim = ref.dim
        self.dtype = dtype
        self.backend = backend
        self.blocks: list[_Block] = []
        self.logdets = torch.zeros(self.num, dtype=dtype)
        self.ranks: list[tuple[int, int, int, int]] = []  # kron blocks: (out, in, kept out, kept in)
        mus = torch.stack([c.map.to(dtype) for c in components])  # (N, d)
        for j, (proto, off) in enumerate(zip(ref.blocks, ref.offsets)):
            blocks = [c.curvature.blocks[j] for c in components]
            mu = mus[:, off : off + proto.dim]
            if isinstance(proto, Diag):
                S = scales[:, None] * torch.stack([b.g.to(dtype) for b in blocks]) + shifts[:, None]
                self.blocks.append(_Block("diag", off, proto.dim, mu, S, None, None))
                self.logdets += S.log().sum(1)
            elif isinstance(proto, Dense):
                eig = [b.eigen() for b in blocks]
                S = scales[:, None] * torch.stack([e[0].to(dtype) for e in eig]) + shifts[:, None]
                U = torch.stack([e[1].to(dtype) for e in eig])
                self.blocks.append(_Block("dense", off, proto.dim, mu, S, U, None))
                self.logdets += S.log().sum(1)
            elif isinstance(proto, Kron):
                self._add_kron(proto, off, mu, [b.eigen() for b in blocks], scales, shifts, lowrank_tol)
            else:
                raise IncompatibleArtifactsError(f"unsupported block type {type(proto).__name__}")

    def _add_kron(self, proto: Kron, off: int, mu: torch.Tensor, eig: list, scales: torch.Tensor,
                  shifts: torch.Tensor, tol: float) -> None:
        dtype = self.dtype
        out, inn = proto.shape
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
        self.logdets += (curv + shifts[:, None, None]).log().flatten(1).sum(1)
        if tol <= 0:
            self.blocks.append(_Block("kron", off, proto.dim, mu.reshape(-1, out, inn),
                                      curv + shifts[:, None, None], UB, UA))
            self.ranks.append((out, inn, out, inn))
            return
        thresh = tol * shifts
        keep_b = (scales[:, None] * b * a[:, -1:] >= thresh[:, None]).sum(1).max().clamp_min(1).item()
        keep_a = (scales[:, None] * a * b[:, -1:] >= thresh[:, None]).sum(1).max().clamp_min(1).item()
        self.ranks.append((out, inn, int(keep_b), int(keep_a)))
        self.blocks.append(_Block("kron", off, proto.dim, mu.reshape(-1, out, inn),
                                  curv[:, -keep_b:, -keep_a:].contiguous(), UB[:, :, -keep_b:].contiguous(),
                                  UA[:, :, -keep_a:].contiguous(), shifts.clone()))

    def to(self, device: str | torch.device) -> StackedGaussians:
        """Move every stacked tensor to ``device`` (in place); returns self."""
        def mv(t):
            return None if t is None else t.to(device)

        self.blocks = [_Block(b.kind, b.offset, b.size, mv(b.mu), mv(b.S), mv(b.U), mv(b.UA), mv(b.shift))
                       for b in self.blocks]
        self.logdets = self.logdets.to(device)
        return self

    def quadratic_forms(self, W: torch.Tensor) -> torch.Tensor:
        """``(K, d)`` points -> ``(K, N)`` quadratic forms ``(w_k − μ_n)ᵀ Λ_n (w_k − μ_n)``."""
        total = torch.zeros(W.shape[0], self.num, dtype=W.dtype, device=W.device)
        for b in self.blocks:
            w = W[:, b.offset : b.offset + b.size]
            if b.kind == "diag":
                total = total + ((w[:, None, :] - b.mu[None]).square() * b.S[None]).sum(-1)
            elif b.kind == "dense":
                z = torch.einsum("knp,npq->knq", w[:, None, :] - b.mu[None], b.U)
                total = total + (z.square() * b.S[None]).sum(-1)
            else:
                Wk = w.reshape(w.shape[0], *b.mu.shape[1:])
                total = total + kron_quadratic_forms(Wk, b.mu, b.U, b.UA, b.S, self.backend)
                if b.shift is not None:  # closed-form λ0 ‖W − μ‖² of the low-rank shortcut
                    flat_mu = b.mu.flatten(1)
                    sq = w.square().sum(1)[:, None] - 2 * w @ flat_mu.T + flat_mu.square().sum(1)[None]
                    total = total + b.shift[None] * sq
        return total
