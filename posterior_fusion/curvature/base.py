"""The precision protocol shared by Diag, Dense, Kron and BlockDiag.

Each structure holds a raw curvature ``G`` (GGN summed over the data, no prior, no
temperature) and represents the positive semi-definite matrix

    Λ = scale · G + shift · I

``scale`` = 1/T and ``shift`` = λ0 turn the curvature into a posterior precision; see
:meth:`Precision.precision`. Raw curvature has ``scale=1, shift=0``. Vectors are flat,
shape ``(..., dim)``; the leading dimensions batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from posterior_fusion.errors import ConfigError


class Precision(ABC):
    """A structured symmetric PSD matrix ``Λ = scale·G + shift·I`` of size ``dim × dim``."""

    def __init__(self, scale: float = 1.0, shift: float = 0.0) -> None:
        if not (scale >= 0 and shift >= 0):
            raise ConfigError(f"scale and shift must be >= 0, got scale={scale}, shift={shift}")
        self._scale = float(scale)
        self._shift = float(shift)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def shift(self) -> float:
        return self._shift

    @property
    @abstractmethod
    def dim(self) -> int:
        """Number of parameters d covered by this matrix."""

    @abstractmethod
    def with_scale_shift(self, scale: float, shift: float) -> Precision:
        """The same curvature with a new ``scale`` and ``shift`` (shares the raw tensors)."""

    def precision(self, temperature: float, prior_precision: float) -> Precision:
        """Posterior precision ``G / temperature + prior_precision · I``."""
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}")
        if not prior_precision > 0:
            raise ConfigError(f"prior precision must be > 0, got {prior_precision}")
        return self.with_scale_shift(1.0 / temperature, prior_precision)

    @abstractmethod
    def quadratic_form(self, v: torch.Tensor) -> torch.Tensor:
        """``vᵀ Λ v`` for ``v`` of shape ``(..., dim)``; returns shape ``(...)``."""

    @abstractmethod
    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``Λ v`` for ``v`` of shape ``(..., dim)``."""

    @abstractmethod
    def logdet(self) -> torch.Tensor:
        """``log |Λ|`` as a 0-d tensor (``-inf`` if Λ is singular)."""

    @abstractmethod
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` draws from ``N(0, Λ⁻¹)``, shape ``(n, dim)``. Requires Λ positive definite."""

    @abstractmethod
    def to_dense(self) -> torch.Tensor:
        """Dense ``(dim, dim)`` matrix Λ (for tests and small problems)."""

    @abstractmethod
    def diagonal(self) -> torch.Tensor:
        """``diag(Λ)``, shape ``(dim,)``."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by the raw curvature tensors."""

    def _check_vec(self, v: torch.Tensor) -> None:
        if v.shape[-1] != self.dim:
            raise ConfigError(f"{type(self).__name__}: vector has last dimension {v.shape[-1]}, expected {self.dim}")


def eigh_psd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a symmetric PSD matrix with eigenvalues clamped at 0.

    Returns ``(eigenvalues (n,), eigenvectors (n, n))``; float32 inputs are decomposed in
    float64 for accuracy and cast back.
    """
    work = matrix.double() if matrix.dtype == torch.float32 else matrix
    evals, evecs = torch.linalg.eigh(0.5 * (work + work.T))
    return evals.clamp_min(0).to(matrix.dtype), evecs.to(matrix.dtype)
