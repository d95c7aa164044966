"""Stacked Gaussian components for fast evaluation of many quadratic forms at once.

``StackedGaussians`` holds N components ``N(μ_n, Λ_n⁻¹)`` that share one block structure
(the curvature blocks of a set of client components) and evaluates, for K points ``W``
``(K, d)``, every quadratic form ``(w_k − μ_n)ᵀ Λ_n (w_k − μ_n)`` as a ``(K, N)`` tensor
in one batched pass per block, plus each ``log|Λ_n|``. Each block position is stacked by its
kind's stacker in :data:`~posterior_fusion.fusion.block_stacks.STACKERS` (found through the block-type
table), so this module has no per-structure code.

Low-rank shortcut (``spectral_cutoff > 0``, Kronecker blocks): eigen-directions whose curvature
``scale · b_i a_j`` is below ``spectral_cutoff · shift`` for every partner direction are dropped
from the rotation and their ``shift ‖·‖²`` contribution is added in closed form, so
``shift ‖V‖²`` is exact and the dropped curvature is at most ``spectral_cutoff · shift ‖V‖²
<= spectral_cutoff · q``: the relative error of every quadratic form is below ``spectral_cutoff``.
Log-determinants always use the full spectra.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from posterior_fusion.errors import IncompatibleArtifactsError
from posterior_fusion.fusion.block_stacks import STACKERS, map_tensors
from posterior_fusion.posterior import Component
from posterior_fusion.progress import progress


class StackedGaussians:
    """N components with precisions ``scale_n·G_n + shift_n·I`` stacked block by block.

    ``scale`` and ``shift`` are one float for all components or one per component;
    ``kernel`` picks the Kronecker kernel (``None``: ``$PFUSE_KERNEL``, else torch; see :mod:`posterior_fusion.kernels`).
    """

    def __init__(self, components: list[Component], scale: float | list[float], shift: float | list[float],
                 dtype: torch.dtype = torch.float32, spectral_cutoff: float = 0.0, kernel: str | None = None,
                 show_progress: bool = True) -> None:
        if not components:
            raise IncompatibleArtifactsError("no components to stack")
        ref = components[0].curvature
        signature = [(b.kind, b.dim) for b in ref.blocks]
        for c in components[1:]:
            if [(b.kind, b.dim) for b in c.curvature.blocks] != signature:
                raise IncompatibleArtifactsError("components have different curvature block structures")
        self.num = len(components)
        scales = torch.as_tensor(scale if isinstance(scale, list) else [scale] * self.num, dtype=dtype)
        shifts = torch.as_tensor(shift if isinstance(shift, list) else [shift] * self.num, dtype=dtype)
        self.dim = ref.dim
        self.dtype = dtype
        mus = torch.stack([c.map.to(dtype) for c in components])  # (N, d)
        self.blocks = []
        blocks = progress(list(zip(ref.blocks, ref.offsets)), f"stacking {self.num} components", len(ref.blocks),
                          show=show_progress)
        for j, (proto, off) in enumerate(blocks):
            if proto.kind not in STACKERS:
                raise IncompatibleArtifactsError(f"block kind {proto.kind!r} has no batched evaluation "
                                                 "(posterior_fusion.fusion.block_stacks.STACKERS)")
            self.blocks.append(STACKERS[proto.kind]([c.curvature.blocks[j] for c in components], off,
                                                    mus[:, off : off + proto.dim], scales, shifts, dtype, spectral_cutoff,
                                                    kernel))
        self.logdets = sum(b.logdets for b in self.blocks)

    @property
    def ranks(self) -> list[tuple[int, int, int, int]]:
        """Kronecker blocks: ``(out, in, kept out, kept in)`` directions."""
        return [b.rank for b in self.blocks if hasattr(b, "rank")]

    def to(self, device: str | torch.device) -> StackedGaussians:
        """Move every stacked tensor to ``device`` (in place); returns self."""
        self.blocks = [b.to(device) for b in self.blocks]
        self.logdets = self.logdets.to(device)
        return self

    def select(self, start: int, stop: int) -> StackedGaussians:
        """Components ``start … stop − 1`` as a stack of views (nothing copied)."""
        sub = copy.copy(self)
        sub.blocks = [map_tensors(b, lambda t: t[start:stop]) for b in self.blocks]
        sub.logdets = self.logdets[start:stop]
        sub.num = stop - start
        return sub

    def quadratic_forms(self, W: torch.Tensor) -> torch.Tensor:
        """``(K, d)`` points -> ``(K, N)`` quadratic forms ``(w_k − μ_n)ᵀ Λ_n (w_k − μ_n)``,
        differentiable w.r.t. ``W``."""
        total = torch.zeros(W.shape[0], self.num, dtype=W.dtype, device=W.device)
        for b in self.blocks:
            total = total + b.quadratic_forms(W[:, b.offset : b.offset + b.size])
        return total

    def forms_and_vjp(self, W: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """``(K, d)`` -> the ``(K, N)`` forms (no autograd graph) and ``vjp(g (K, N)) -> (K, d)``,
        the gradient of ``Σ g ∘ q`` w.r.t. ``W`` (each block keeps what its gradient reuses)."""
        W = W.detach()
        total, vjps = None, []
        for b in self.blocks:
            q, vjp = b.forms_and_vjp(W[:, b.offset : b.offset + b.size])
            total = q if total is None else total + q
            vjps.append(vjp)

        def vjp(g: torch.Tensor) -> torch.Tensor:
            grad = torch.zeros_like(W)
            for b, block_vjp in zip(self.blocks, vjps):
                grad[:, b.offset : b.offset + b.size] = block_vjp(g)
            return grad

        return total, vjp
