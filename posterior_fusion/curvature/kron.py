"""Kronecker-factored curvature of one weight matrix: ``Λ = scale · (B ⊗ A) + shift · I``.

``B`` is ``(out, out)``, ``A`` is ``(in, in)`` (conv weights flattened to ``out × in·k·k``).
A parameter vector ``v`` of this block is read row-major as ``V`` of shape ``(out, in)``,
so ``(B ⊗ A) vec(V) = vec(B V Aᵀ)``. With ``A = U_A diag(a) U_Aᵀ`` and
``B = U_B diag(b) U_Bᵀ``:

    Z = U_Bᵀ V U_A ;  vᵀΛv = Σ_ij Z_ij² (scale·b_i a_j + shift) ;  log|Λ| = Σ_ij log(scale·b_i a_j + shift)

This matches laplace-torch's ``KronDecomposed`` (first factor = output side).
"""

from __future__ import annotations

import torch

from posterior_fusion.curvature.base import Precision, eigh_psd


class Kron(Precision):
    """Two-factor Kronecker block for a weight of matrix shape ``(out, in)``."""

    def __init__(self, B: torch.Tensor, A: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale, shift)
        self.B = B
        self.A = A
        self._eig: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.B.shape[0], self.A.shape[0]

    @property
    def dim(self) -> int:
        return self.B.shape[0] * self.A.shape[0]

    def with_scale_shift(self, scale: float, shift: float) -> Kron:
        out = Kron(self.B, self.A, scale, shift)
        out._eig = self._eig
        return out

    def eigen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw factor eigenpairs ``(b (out,), U_B (out,out), a (in,), U_A (in,in))``."""
        if self._eig is None:
            b, UB = eigh_psd(self.B)
            a, UA = eigh_psd(self.A)
            self._eig = (b, UB, a, UA)
        return self._eig

    def eigenvalue_grid(self) -> torch.Tensor:
        """Eigenvalues of Λ as an ``(out, in)`` grid ``scale · b aᵀ + shift``."""
        b, _, a, _ = self.eigen()
        return self.scale * torch.outer(b, a) + self.shift

    def _rotate(self, v: torch.Tensor) -> torch.Tensor:
        _, UB, _, UA = self.eigen()
        V = v.reshape(*v.shape[:-1], *self.shape)
        return UB.T @ V @ UA

    def quadratic_form(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        Z = self._rotate(v)
        return (Z.square() * self.eigenvalue_grid()).sum((-2, -1))

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        V = v.reshape(*v.shape[:-1], *self.shape)
        out = self.scale * (self.B @ V @ self.A.T) + self.shift * V
        return out.reshape(v.shape)

    def logdet(self) -> torch.Tensor:
        return self.eigenvalue_grid().log().sum()

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        _, UB, _, UA = self.eigen()
        eps = torch.randn(n, *self.shape, generator=generator, dtype=self.B.dtype)
        X = UB @ (eps * self.eigenvalue_grid().rsqrt()) @ UA.T
        return X.reshape(n, self.dim)

    def diagonal(self) -> torch.Tensor:
        return (self.scale * torch.outer(torch.diagonal(self.B), torch.diagonal(self.A)) + self.shift).reshape(-1)

    def to_dense(self) -> torch.Tensor:
        return self.scale * torch.kron(self.B, self.A) + self.shift * torch.eye(self.dim, dtype=self.B.dtype)

    @property
    def nbytes(self) -> int:
        return (self.B.numel() + self.A.numel()) * self.B.element_size()
