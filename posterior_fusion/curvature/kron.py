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

    kind = "kron"

    def __init__(self, B: torch.Tensor, A: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale, shift)
        self.B = B
        self.A = A

    def share_storage(self, name: str, tensor: torch.Tensor) -> None:
        """Hold factor ``name`` (``"B"`` or ``"A"``) in ``tensor`` — a row of a stack of many blocks' factors —
        so its values are stored once. The block's values do not change: ``tensor`` must equal the factor
        exactly (checked), so a loaded block stays what it was read as."""
        current = getattr(self, name)
        if name not in ("B", "A") or tensor.shape != current.shape or tensor.dtype != current.dtype \
                or not torch.equal(tensor, current):
            raise ValueError(f"share_storage: {name} must be given as a tensor equal to the factor it replaces")
        setattr(self, name, tensor)

    @property
    def shape(self) -> tuple[int, int]:
        return self.B.shape[0], self.A.shape[0]

    @property
    def dim(self) -> int:
        return self.B.shape[0] * self.A.shape[0]

    def with_scale_shift(self, scale: float, shift: float) -> Kron:
        return self._share_cache(Kron(self.B, self.A, scale, shift))

    def damped(self, n: float, d: float) -> Kron:
        eye = lambda F: torch.eye(F.shape[0], dtype=F.dtype, device=F.device)  # noqa: E731
        return Kron(self.B + n * d * eye(self.B), self.A + d * eye(self.A), self.scale, self.shift)

    def astype(self, dtype: torch.dtype) -> Kron:
        out = Kron(self.B.to(dtype), self.A.to(dtype), self.scale, self.shift)
        for key, value in self._raw_cache.items():
            out._raw_cache[key] = tuple(t.to(dtype) for t in value)
        return out

    def eigenvalues(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw factor eigenvalues ``(b (out,), a (in,))`` clamped at 0, from the eigenpairs when they
        are known, else without eigenvectors (``eigvalsh``: less work, no ``D × D`` basis kept)."""
        if self._eig is not None:
            return self._eig[0], self._eig[2]
        if "eigvals" not in self._raw_cache:
            self._raw_cache["eigvals"] = tuple(  # eigvalsh reads one triangle: no symmetrised copy
                torch.linalg.eigvalsh(F.double()).clamp_min(0).to(F.dtype) for F in (self.B, self.A))
        return self._raw_cache["eigvals"]

    def eigen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw factor eigenpairs ``(b (out,), U_B (out,out), a (in,), U_A (in,in))``."""
        if self._eig is None:
            b, UB = eigh_psd(self.B)
            a, UA = eigh_psd(self.A)
            self._eig = (b, UB, a, UA)
        return self._eig

    def eigenvalue_grid(self) -> torch.Tensor:
        """Eigenvalues of Λ as an ``(out, in)`` grid ``scale · b aᵀ + shift``."""
        b, a = self.eigenvalues()
        return self.scale * torch.outer(b, a) + self.shift

    def _rotate(self, v: torch.Tensor) -> torch.Tensor:
        _, UB, _, UA = self.eigen()
        V = v.reshape(*v.shape[:-1], *self.shape)
        return UB.T @ V @ UA

    def quadratic_form(self, v: torch.Tensor) -> torch.Tensor:
        """``scale · ⟨V, B V Aᵀ⟩ + shift · ‖V‖²`` straight from the factors (no decomposition)."""
        self._check_vec(v)
        V = v.reshape(*v.shape[:-1], *self.shape)
        return self.scale * (V * (self.B @ V @ self.A.T)).sum((-2, -1)) + self.shift * V.square().sum((-2, -1))

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        V = v.reshape(*v.shape[:-1], *self.shape)
        out = self.scale * (self.B @ V @ self.A.T) + self.shift * V
        return out.reshape(v.shape)

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        _, UB, _, UA = self.eigen()
        Z = self._rotate(v) / self.eigenvalue_grid()
        return (UB @ Z @ UA.T).reshape(v.shape)

    def whiten(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return (self._rotate(v) * self.eigenvalue_grid().rsqrt()).reshape(v.shape)

    def spectrum(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, a = self.eigenvalues()
        return self.scale * b.double(), a.double()

    def logdet(self) -> torch.Tensor:
        """``Σ_ij log(scale·b_i a_j + shift)`` in float64 from the (cached) factor eigenvalues, whatever the
        factors' dtype: a float32 block's log-determinant is as exact as its float64 copy's, without the copy."""
        b, a = self.eigenvalues()
        return (self.scale * torch.outer(b.double(), a.double()) + self.shift).log().sum()

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

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that define the block, by name (stored as they are: ``artifact/blocks.py``)."""
        return {"kron_B": self.B, "kron_A": self.A}

    @classmethod
    def weighted_sum(cls, blocks: list[Precision], weights: torch.Tensor, iterations: int = 500) -> tuple[Kron, float]:
        """The Frobenius-nearest Kronecker product ``B̃ ⊗ Ã`` to ``T = Σ_n w_n B_n ⊗ A_n``
        (Van Loan & Pitsianis: the top singular pair of the rearranged ``Σ_n w_n vec(B_n) vec(A_n)ᵀ``),
        computed in the N-dimensional span of the factors: ``B̃ = Σ α_n B_n``, ``Ã = Σ β_n A_n``.
        Exact when the clients' factors are proportional; PSD because every Gram entry
        ``⟨B_n, B_m⟩`` of PSD factors and every weight is non-negative. Returns ``(Kron(B̃, Ã),
        ‖T − B̃ ⊗ Ã‖_F / ‖T‖_F)``."""
        return cls.weighted_sums(blocks, torch.as_tensor(weights)[None], iterations)[0]

    @classmethod
    def weighted_sums(cls, blocks: list[Precision], weights: torch.Tensor,
                      iterations: int = 500) -> list[tuple[Kron, float]]:
        """:meth:`weighted_sum` for each row of ``weights`` ``(K, N)``: the factors' Gram matrices
        ``⟨B_n, B_m⟩``, ``⟨A_n, A_m⟩`` (the O(N² D²) part) are computed once for all K rows, in float64
        over column chunks of the stored factors (no float64 copy of all N factors)."""
        W = torch.as_tensor(weights, dtype=torch.float64).clamp_min(0)
        Bs, As = [b.B for b in blocks], [b.A for b in blocks]  # once: a compact block rebuilds them on access
        GB, GA = _gram(Bs), _gram(As)
        out = []
        for w in W:
            total_sq = float(w @ (GB * GA) @ w)
            if total_sq <= 0:
                out.append((Kron(torch.zeros_like(Bs[0], dtype=torch.float64),
                                torch.zeros_like(As[0], dtype=torch.float64)), 0.0))
                continue
            M = (w[:, None] * GA * w[None, :]) @ GB
            alpha = torch.full((len(blocks),), 1.0 / len(blocks), dtype=torch.float64)
            for _ in range(iterations):  # power iteration; M is similar to a symmetric PSD matrix
                nxt = M @ alpha
                nxt = nxt / nxt.norm().clamp_min(1e-300)
                if torch.allclose(nxt, alpha, rtol=0, atol=1e-14):
                    alpha = nxt
                    break
                alpha = nxt
            u_norm = float(alpha @ GB @ alpha) ** 0.5
            alpha = alpha / u_norm                        # ‖B̃‖_F = 1
            beta = w * (GB @ alpha)                       # Ã = Rᵀ vec(B̃)
            B = _combine(Bs, alpha)
            A = _combine(As, beta)
            cross = float((w * (GB @ alpha) * (GA @ beta)).sum())
            approx_sq = float(beta @ GA @ beta)
            err = max(total_sq - 2 * cross + approx_sq, 0.0) ** 0.5 / total_sq ** 0.5
            dtype = Bs[0].dtype  # combined in float64, kept in the factors' dtype (K modes' worth)
            out.append((Kron((0.5 * (B + B.T)).to(dtype), (0.5 * (A + A.T)).to(dtype)), err))
        return out


GRAM_BYTES = 64 * 2**20  # the float64 working block of :func:`_gram`, whatever the number of factors


def _gram(factors: list[torch.Tensor], max_bytes: int = GRAM_BYTES) -> torch.Tensor:
    """``⟨F_n, F_m⟩`` ``(N, N)`` in float64 for N equal-shape matrices, over column chunks of their
    entries: one ``(N, chunk)`` float64 block of at most ``max_bytes`` is filled in place per chunk (a
    stack of converted slices held every slice twice, and its chunk did not shrink with N: at N = 100
    components of a 576 × 576 factor the Laplace step at the modes peaked 0.8 GB above the optimisation)."""
    flat = [f.reshape(-1) for f in factors]
    n, size = len(flat), flat[0].numel()
    chunk = max(1, min(size, max_bytes // (8 * n)))
    G = torch.zeros(n, n, dtype=torch.float64)
    X = torch.empty(n, chunk, dtype=torch.float64)
    for start in range(0, size, chunk):
        part = X[:, : min(chunk, size - start)]
        for row, f in zip(part, flat):
            row.copy_(f[start : start + part.shape[1]])
        G += part @ part.T
    return G


def _combine(factors: list[torch.Tensor], coef: torch.Tensor) -> torch.Tensor:
    """``Σ_n coef_n F_n`` in float64."""
    out = torch.zeros(factors[0].shape, dtype=torch.float64)
    for c, f in zip(coef.tolist(), factors):
        out.add_(f.double(), alpha=c)
    return out
