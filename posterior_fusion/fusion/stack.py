"""Stacked Gaussian components for fast evaluation of many quadratic forms at once.

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
from posterior_fusion.kernels import kron_quadratic_form


@dataclass(frozen=True)
class _Block:
    kind: str               # "diag" | "dense" | "kron"
    offset: int
    size: int
    mu: torch.Tensor        # (N, size) or (N, out, in) for kron
    S: torch.Tensor         # eigenvalues of Λ: (N, size) or (N, out, in)
    U: torch.Tensor | None  # dense: (N, size, size); kron: U_B (N, out, out)
    UA: torch.Tensor | None  # kron: U_A (N, in, in)


class StackedGaussians:
    """N components with precisions ``scale_n·G_n + shift_n·I`` stacked block by block.

    ``scale`` and ``shift`` are one float for all components or one per component.
    """

    def __init__(self, components: list[Component], scale: float | list[float], shift: float | list[float],
                 dtype: torch.dtype = torch.float32) -> None:
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
        self.blocks: list[_Block] = []
        mus = torch.stack([c.map.to(dtype) for c in components])  # (N, d)
        for j, (proto, off) in enumerate(zip(ref.blocks, ref.offsets)):
            blocks = [c.curvature.blocks[j] for c in components]
            mu = mus[:, off : off + proto.dim]
            if isinstance(proto, Diag):
                S = scales[:, None] * torch.stack([b.g.to(dtype) for b in blocks]) + shifts[:, None]
                self.blocks.append(_Block("diag", off, proto.dim, mu, S, None, None))
            elif isinstance(proto, Dense):
                eig = [b.eigen() for b in blocks]
                S = scales[:, None] * torch.stack([e[0].to(dtype) for e in eig]) + shifts[:, None]
                U = torch.stack([e[1].to(dtype) for e in eig])
                self.blocks.append(_Block("dense", off, proto.dim, mu, S, U, None))
            elif isinstance(proto, Kron):
                out, inn = proto.shape
                eig = [b.eigen() for b in blocks]
                S = (scales[:, None, None] * torch.stack([torch.outer(e[0], e[2]).to(dtype) for e in eig])
                     + shifts[:, None, None])
                UB = torch.stack([e[1].to(dtype) for e in eig])
                UA = torch.stack([e[3].to(dtype) for e in eig])
                self.blocks.append(_Block("kron", off, proto.dim, mu.reshape(-1, out, inn), S, UB, UA))
            else:
                raise IncompatibleArtifactsError(f"unsupported block type {type(proto).__name__}")
        self.logdets = sum(b.S.log().flatten(1).sum(1) for b in self.blocks)  # (N,)

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
                V = w.reshape(w.shape[0], 1, *b.mu.shape[1:]) - b.mu[None]
                total = total + kron_quadratic_form(V, b.U, b.UA, b.S)
        return total
