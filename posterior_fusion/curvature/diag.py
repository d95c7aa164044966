"""Diagonal curvature: ``Λ = diag(scale · g + shift)``."""

from __future__ import annotations

import torch

from posterior_fusion.curvature.base import Precision


class Diag(Precision):
    """Diagonal structure; ``g`` has shape ``(d,)`` and is >= 0."""

    def __init__(self, g: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale, shift)
        self.g = g

    @property
    def dim(self) -> int:
        return self.g.shape[0]

    def with_scale_shift(self, scale: float, shift: float) -> Diag:
        return Diag(self.g, scale, shift)

    def diagonal(self) -> torch.Tensor:
        return self.scale * self.g + self.shift

    def quadratic_form(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return (v.square() * self.diagonal()).sum(-1)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return v * self.diagonal()

    def logdet(self) -> torch.Tensor:
        return self.diagonal().log().sum()

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        eps = torch.randn(n, self.dim, generator=generator, dtype=self.g.dtype)
        return eps * self.diagonal().rsqrt()

    def to_dense(self) -> torch.Tensor:
        return torch.diag(self.diagonal())

    @property
    def nbytes(self) -> int:
        return self.g.numel() * self.g.element_size()
