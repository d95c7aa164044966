"""Diagonal curvature: ``Λ = diag(scale · g + shift)``."""

from __future__ import annotations

import torch

from posterior_fusion.curvature.base import Precision


class Diag(Precision):
    """Diagonal structure; ``g`` has shape ``(d,)`` and is >= 0."""

    kind = "diag"

    def __init__(self, g: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale, shift)
        self.g = g

    @property
    def dim(self) -> int:
        return self.g.shape[0]

    def with_scale_shift(self, scale: float, shift: float) -> Diag:
        return Diag(self.g, scale, shift)

    def damped(self, n: float, d: float) -> Diag:
        return Diag(self.g + n * d, self.scale, self.shift)

    def astype(self, dtype: torch.dtype) -> Diag:
        return Diag(self.g.to(dtype), self.scale, self.shift)

    def diagonal(self) -> torch.Tensor:
        return self.scale * self.g + self.shift

    def quadratic_form(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return (v.square() * self.diagonal()).sum(-1)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return v * self.diagonal()

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return v / self.diagonal()

    def whiten(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return v * self.diagonal().rsqrt()

    def spectrum(self) -> tuple[torch.Tensor, None]:
        return self.scale * self.g.double(), None

    def logdet(self) -> torch.Tensor:
        return (self.scale * self.g.double() + self.shift).log().sum()  # float64 whatever g's dtype

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        eps = torch.randn(n, self.dim, generator=generator, dtype=self.g.dtype)
        return eps * self.diagonal().rsqrt()

    def to_dense(self) -> torch.Tensor:
        return torch.diag(self.diagonal())

    @property
    def nbytes(self) -> int:
        return self.g.numel() * self.g.element_size()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that define the block, by name (stored as they are: ``artifact/blocks.py``)."""
        return {"diag": self.g}

    @classmethod
    def weighted_sum(cls, blocks: list[Precision], weights: torch.Tensor) -> tuple[Diag, float]:
        return cls(sum(float(w) * b.g.double() for w, b in zip(weights, blocks))), 0.0

    @classmethod
    def sum_of(cls, blocks: list[Precision], extra_shift: float = 0.0) -> Diag:
        # scaled in float64: without a prior the sum can be ill-conditioned (hbfl)
        return cls(sum(b.scale * b.g.double() + b.shift for b in blocks) + extra_shift)


