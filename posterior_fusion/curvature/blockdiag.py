"""Block-diagonal composition of structures over consecutive slices of the parameters."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posterior_fusion.curvature.base import Precision
from posterior_fusion.errors import ConfigError


class BlockDiag(Precision):
    """``Λ = blockdiag(Λ_1, ..., Λ_k)``; block i covers ``[offsets[i], offsets[i] + dim_i)``.

    The ``scale``/``shift`` of a BlockDiag are pushed into its blocks; ``shift`` may be one number per
    block (a prior precision per block: fedbens' ``server_prior=evidence``), and ``shift`` then returns
    that tuple.
    """

    def __init__(self, blocks: list[Precision], scale: float = 1.0, shift: float | Sequence[float] = 0.0) -> None:
        per_block = isinstance(shift, Sequence)
        shifts = tuple(float(v) for v in shift) if per_block else (float(shift),) * len(blocks)
        if len(shifts) != len(blocks):
            raise ConfigError(f"{len(shifts)} shifts given for {len(blocks)} blocks")
        super().__init__(scale, min(shifts, default=0.0))
        self._shifts = shifts if per_block else None
        self.blocks = tuple(b.with_scale_shift(scale, v) for b, v in zip(blocks, shifts))
        offsets, total = [], 0
        for b in self.blocks:
            offsets.append(total)
            total += b.dim
        self.offsets = tuple(offsets)
        self._dim = total

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def shift(self) -> float | tuple[float, ...]:
        return self._shift if self._shifts is None else self._shifts

    def with_scale_shift(self, scale: float, shift: float | Sequence[float]) -> BlockDiag:
        return BlockDiag(list(self.blocks), scale, shift)

    def precision(self, temperature: float, prior_precision: float | Sequence[float]) -> BlockDiag:
        """``G / temperature + prior_precision · I``, ``prior_precision`` one number or one per block."""
        if not isinstance(prior_precision, Sequence):
            return super().precision(temperature, prior_precision)
        if not all(v > 0 for v in prior_precision):
            raise ConfigError(f"prior precision must be > 0, got {prior_precision}")
        super().precision(temperature, 1.0)  # the temperature's check
        return self.with_scale_shift(1.0 / temperature, prior_precision)

    def astype(self, dtype: torch.dtype) -> BlockDiag:
        return BlockDiag([b.astype(dtype) for b in self.blocks], self.scale, self.shift)

    def damped(self, n: float, d: float) -> BlockDiag:
        return BlockDiag([b.damped(n, d) for b in self.blocks], self.scale, self.shift)

    def _slices(self, v: torch.Tensor):
        for block, off in zip(self.blocks, self.offsets):
            yield block, v[..., off : off + block.dim]

    def quadratic_form(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return sum(block.quadratic_form(part) for block, part in self._slices(v))

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return torch.cat([block.matvec(part) for block, part in self._slices(v)], dim=-1)

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0].dtype

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return torch.cat([block.solve(part) for block, part in self._slices(v)], dim=-1)

    def whiten(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return torch.cat([block.whiten(part) for block, part in self._slices(v)], dim=-1)

    def spectrum(self) -> tuple[torch.Tensor, None]:
        """Every block's eigenvalues (no shift), in block order: ``(dim,)`` numbers, not factored."""
        parts = [b if a is None else torch.outer(b, a).reshape(-1) for b, a in (blk.spectrum() for blk in self.blocks)]
        return torch.cat(parts), None

    def logdet(self) -> torch.Tensor:
        return sum(block.logdet() for block in self.blocks)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.cat([block.sample(n, generator) for block in self.blocks], dim=-1)

    def diagonal(self) -> torch.Tensor:
        return torch.cat([block.diagonal() for block in self.blocks])

    def to_dense(self) -> torch.Tensor:
        return torch.block_diag(*[block.to_dense() for block in self.blocks])

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)
