"""Dense curvature block: ``Λ = scale · G + shift · I`` with ``G`` of shape ``(p, p)``."""

from __future__ import annotations

import torch

from posterior_fusion.curvature.base import Precision, eigh_psd


class Dense(Precision):
    """Full symmetric PSD block (e.g. the last layer of diag+full, or a bias block of kron)."""

    kind = "dense"

    def __init__(self, G: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale, shift)
        self.G = G

    @property
    def dim(self) -> int:
        return self.G.shape[0]

    def with_scale_shift(self, scale: float, shift: float) -> Dense:
        return self._share_cache(Dense(self.G, scale, shift))

    def damped(self, n: float, d: float) -> Dense:
        return Dense(self.G + n * d * torch.eye(self.G.shape[0], dtype=self.G.dtype, device=self.G.device),
                     self.scale, self.shift)

    def astype(self, dtype: torch.dtype) -> Dense:
        out = Dense(self.G.to(dtype), self.scale, self.shift)
        if self._eig is not None:
            out._eig = tuple(t.to(dtype) for t in self._eig)
        return out

    def eigen(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw eigenpairs of ``G``: ``(g (p,), U (p, p))`` with ``G = U diag(g) Uᵀ``."""
        if self._eig is None:
            self._eig = eigh_psd(self.G)
        return self._eig

    def eigenvalues(self) -> torch.Tensor:
        """Eigenvalues of Λ, shape ``(p,)``."""
        return self.scale * self.eigen()[0] + self.shift

    def diagonal(self) -> torch.Tensor:
        return self.scale * torch.diagonal(self.G) + self.shift

    def quadratic_form(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        _, U = self.eigen()
        return ((v @ U).square() * self.eigenvalues()).sum(-1)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return self.scale * (v @ self.G) + self.shift * v  # G is symmetric

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        if v.ndim == 1:
            return torch.linalg.solve(self.to_dense(), v)
        return torch.linalg.solve(self.to_dense(), v.reshape(-1, self.dim).T).T.reshape(v.shape)

    def whiten(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        _, U = self.eigen()
        return (v @ U) * self.eigenvalues().rsqrt()

    def spectrum(self) -> tuple[torch.Tensor, None]:
        return self.scale * self.eigen()[0].double(), None

    def logdet(self) -> torch.Tensor:
        """In float64 from the (cached) eigenvalues of ``G``, whatever its dtype."""
        return (self.scale * self.eigen()[0].double() + self.shift).log().sum()

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        _, U = self.eigen()
        eps = torch.randn(n, self.dim, generator=generator, dtype=self.G.dtype)
        return (eps * self.eigenvalues().rsqrt()) @ U.T

    def to_dense(self) -> torch.Tensor:
        return self.scale * self.G + self.shift * torch.eye(self.dim, dtype=self.G.dtype)

    @property
    def nbytes(self) -> int:
        return self.G.numel() * self.G.element_size()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that define the block, by name (stored as they are: ``artifact/blocks.py``)."""
        return {"dense": self.G}

    @classmethod
    def weighted_sum(cls, blocks: list[Precision], weights: torch.Tensor) -> tuple[Dense, float]:
        return cls(sum(float(w) * b.G.double() for w, b in zip(weights, blocks))), 0.0

    @classmethod
    def sum_of(cls, blocks: list[Precision], extra_shift: float = 0.0) -> Dense:
        eye = torch.eye(blocks[0].dim, dtype=torch.float64)
        # scaled in float64: without a prior the sum can be ill-conditioned (hbfl)
        return cls(sum(b.scale * b.G.double() + b.shift * eye for b in blocks) + extra_shift * eye)


