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
from typing import ClassVar

import torch

from posterior_fusion.errors import ConfigError, MethodNotApplicableError


class Precision(ABC):
    """A structured symmetric PSD matrix ``Λ = scale·G + shift·I`` of size ``dim × dim``.

    Every concrete block type has a ``kind`` (the block-type table
    :data:`posterior_fusion.curvature.BLOCK_TYPES` is keyed by it) and :meth:`to_tensors`. How it
    is stored is the artifact's (:mod:`posterior_fusion.artifact.blocks`); how N of them are
    evaluated at once is fusion's (:mod:`posterior_fusion.fusion.block_stacks`).
    """

    kind: ClassVar[str] = ""

    def __init__(self, scale: float = 1.0, shift: float = 0.0) -> None:
        if not (scale >= 0 and shift >= 0):
            raise ConfigError(f"scale and shift must be >= 0, got scale={scale}, shift={shift}")
        self._scale = float(scale)
        self._shift = float(shift)
        # Decompositions of the raw curvature, shared by every copy made with with_scale_shift:
        # re-tempering (precision(T, λ0)) never repeats an eigendecomposition.
        self._raw_cache: dict[str, object] = {}

    def _share_cache(self, other: Precision) -> Precision:
        """``other`` (a re-scaled copy of this curvature) uses this object's decomposition cache."""
        other._raw_cache = self._raw_cache
        return other

    @property
    def _eig(self):
        return self._raw_cache.get("eig")

    @_eig.setter
    def _eig(self, value) -> None:
        self._raw_cache["eig"] = value

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def shift(self) -> float:
        return self._shift

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the stored curvature tensors."""
        return next(iter(self.to_tensors().values())).dtype

    @property
    @abstractmethod
    def dim(self) -> int:
        """Number of parameters d covered by this matrix."""

    @abstractmethod
    def with_scale_shift(self, scale: float, shift: float) -> Precision:
        """The same curvature with a new ``scale`` and ``shift`` (shares the raw tensors)."""

    def damped(self, n: float, d: float) -> Precision:
        """This raw curvature with Tikhonov damping ``d`` at per-sample scale (``n`` samples): a
        Kronecker block's factors each get ``d`` (``(B + n·d·I) ⊗ (A + d·I)``: B sums over the samples,
        A averages: K-FAC's factored damping, FedLPA's), any other block ``n·d`` on its diagonal."""
        raise NotImplementedError(f"{type(self).__name__} has no damped")

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
    def spectrum(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eigenvalues of ``scale·G`` (no shift) in float64, factored where the structure allows:
        ``(b (out,), a (in,))`` for a Kronecker block (eigenvalues ``b_i a_j``: ``out + in`` numbers), else
        ``(λ (dim,), None)``."""

    @abstractmethod
    def logdet(self) -> torch.Tensor:
        """``log |Λ|`` as a 0-d float64 tensor (summed in float64; ``-inf`` if Λ is singular)."""

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

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        """``Λ⁻¹ v`` for ``v`` of shape ``(..., dim)`` (Λ must be positive definite)."""
        raise NotImplementedError(f"{type(self).__name__} has no solve")

    def whiten(self, v: torch.Tensor) -> torch.Tensor:
        """``u = Λ^{-1/2} v`` in the eigenbasis, ``(..., dim)``: ``u·u' = vᵀ Λ⁻¹ v'`` (one rotation,
        half the work of :meth:`solve` when only such inner products are needed)."""
        raise NotImplementedError(f"{type(self).__name__} has no whiten")

    def astype(self, dtype: torch.dtype) -> Precision:
        """The same block in ``dtype`` (scale and shift kept; a cached decomposition is converted, not
        recomputed)."""
        raise NotImplementedError(f"{type(self).__name__} has no astype")

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that define the block, by name (how they are stored is the artifact's:
        :mod:`posterior_fusion.artifact.blocks`)."""
        raise NotImplementedError

    @classmethod
    def weighted_sum(cls, blocks: list[Precision], weights: torch.Tensor) -> tuple[Precision, float]:
        """Raw curvature ``Σ_n weights[n] · G_n`` of N raw blocks in this structure, float64,
        and the relative Frobenius error of the representation (0 where it is exact)."""
        raise NotImplementedError

    @classmethod
    def weighted_sums(cls, blocks: list[Precision], weights: torch.Tensor) -> list[tuple[Precision, float]]:
        """:meth:`weighted_sum` for each row of ``weights`` ``(K, N)`` (a structure may share work
        between the rows)."""
        return [cls.weighted_sum(blocks, w) for w in weights]

    @classmethod
    def sum_of(cls, blocks: list[Precision], extra_shift: float = 0.0) -> Precision:
        """``Σ_i Λ_i + extra_shift · I`` in this structure, float64 (closed-form products of
        Gaussians); a structure whose sums leave it raises :class:`MethodNotApplicableError`."""
        raise MethodNotApplicableError(f"a sum of {cls.kind} blocks is not a {cls.kind} block")

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
