"""Kronecker-factored curvature of one weight matrix: ``Λ = scale · (B ⊗ A) + shift · I``.

``B`` is ``(out, out)``, ``A`` is ``(in, in)`` (conv weights flattened to ``out × in·k·k``).
A parameter vector ``v`` of this block is read row-major as ``V`` of shape ``(out, in)``,
so ``(B ⊗ A) vec(V) = vec(B V Aᵀ)``. With ``A = U_A diag(a) U_Aᵀ`` and
``B = U_B diag(b) U_Bᵀ``:

    Z = U_Bᵀ V U_A ;  vᵀΛv = Σ_ij Z_ij² (scale·b_i a_j + shift) ;  log|Λ| = Σ_ij log(scale·b_i a_j + shift)

This matches laplace-torch's ``KronDecomposed`` (first factor = output side).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from posterior_fusion.curvature.base import BlockValueError, Precision, check_psd_factor, eigh_psd, map_tensors
from posterior_fusion.kernels import VJP, FormsWithVJP, kron_direct_forms_and_vjp, kron_quadratic_forms_and_vjp


class Kron(Precision):
    """Two-factor Kronecker block for a weight of matrix shape ``(out, in)``."""

    kind = "kron"
    dataset_names = ("kron_B", "kron_A")

    def __init__(self, B: torch.Tensor, A: torch.Tensor, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale, shift)
        self.B = B
        self.A = A

    @property
    def shape(self) -> tuple[int, int]:
        return self.B.shape[0], self.A.shape[0]

    @property
    def dim(self) -> int:
        return self.B.shape[0] * self.A.shape[0]

    def with_scale_shift(self, scale: float, shift: float) -> Kron:
        return self._share_cache(Kron(self.B, self.A, scale, shift))

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

    def solve(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        _, UB, _, UA = self.eigen()
        Z = self._rotate(v) / self.eigenvalue_grid()
        return (UB @ Z @ UA.T).reshape(v.shape)

    def whiten(self, v: torch.Tensor) -> torch.Tensor:
        self._check_vec(v)
        return (self._rotate(v) * self.eigenvalue_grid().rsqrt()).reshape(v.shape)

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

    # --- storage and stacking ---------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        return {"shape": list(self.shape)}

    @classmethod
    def dataset_shapes(cls, size: int, header: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        shape = header.get("shape")
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
                or shape[0] * shape[1] != size):
            raise BlockValueError("shape", "kron block needs shape [out, in] with out*in == size")
        return {"kron_B": (shape[0], shape[0]), "kron_A": (shape[1], shape[1])}

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"kron_B": self.B, "kron_A": self.A}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> Kron:
        for name in cls.dataset_names:
            check_psd_factor(name, tensors[name])
        return cls(tensors["kron_B"], tensors["kron_A"])

    @classmethod
    def weighted_sum(cls, blocks: list[Precision], weights: torch.Tensor, iterations: int = 500) -> tuple[Kron, float]:
        """The Frobenius-nearest Kronecker product ``B̃ ⊗ Ã`` to ``T = Σ_n w_n B_n ⊗ A_n``
        (Van Loan & Pitsianis: the top singular pair of the rearranged ``Σ_n w_n vec(B_n) vec(A_n)ᵀ``),
        computed in the N-dimensional span of the factors: ``B̃ = Σ α_n B_n``, ``Ã = Σ β_n A_n``.
        Exact when the clients' factors are proportional; PSD because every Gram entry
        ``⟨B_n, B_m⟩`` of PSD factors and every weight is non-negative. Returns ``(Kron(B̃, Ã),
        ‖T − B̃ ⊗ Ã‖_F / ‖T‖_F)``."""
        w = torch.as_tensor(weights, dtype=torch.float64).clamp_min(0)
        Bs = torch.stack([b.B.double() for b in blocks])
        As = torch.stack([b.A.double() for b in blocks])
        GB = torch.einsum("nij,mij->nm", Bs, Bs)
        GA = torch.einsum("nij,mij->nm", As, As)
        total_sq = float(w @ (GB * GA) @ w)
        if total_sq <= 0:
            return cls(torch.zeros_like(Bs[0]), torch.zeros_like(As[0])), 0.0
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
        B = torch.einsum("n,nij->ij", alpha, Bs)
        A = torch.einsum("n,nij->ij", beta, As)
        cross = float((w * (GB @ alpha) * (GA @ beta)).sum())
        approx_sq = float(beta @ GA @ beta)
        err = max(total_sq - 2 * cross + approx_sq, 0.0) ** 0.5 / total_sq ** 0.5
        return cls(0.5 * (B + B.T), 0.5 * (A + A.T)), err

    @classmethod
    def stacked(cls, blocks, offset, mu, scales, shifts, dtype, lowrank_tol=0.0, kernel=None) -> StackedKron:
        """Eigen-bases sorted ascending per component; with ``lowrank_tol > 0`` the low-rank
        shortcut of ``fusion/stack.py`` keeps only directions with curvature ``>= tol · shift``."""
        out, inn = blocks[0].shape
        eig = [b.eigen() for b in blocks]
        b = torch.stack([e[0].to(dtype) for e in eig])  # (N, out)
        a = torch.stack([e[2].to(dtype) for e in eig])  # (N, in)
        UB = torch.stack([e[1].to(dtype) for e in eig])
        UA = torch.stack([e[3].to(dtype) for e in eig])
        # Ascending order per component, whatever order the decomposition came in.
        b, ib = b.sort(dim=1)
        a, ia = a.sort(dim=1)
        UB = UB.gather(2, ib[:, None, :].expand_as(UB))
        UA = UA.gather(2, ia[:, None, :].expand_as(UA))
        curv = scales[:, None, None] * b[:, :, None] * a[:, None, :]  # (N, out, in)
        logdets = (curv + shifts[:, None, None]).log().flatten(1).sum(1)
        mu = mu.reshape(-1, out, inn)
        if lowrank_tol <= 0:
            # raw factors rebuilt from the clamped spectra: the direct form is the same matrix
            Bs = (UB * b[:, None, :]) @ UB.transpose(1, 2)
            As = (UA * a[:, None, :]) @ UA.transpose(1, 2)
            mu = mu.to(dtype)
            direct = (Bs, As, Bs @ mu, scales.to(dtype).clone(), shifts.to(dtype).clone(), mu.flatten(1).square().sum(1))
            return StackedKron(offset, out * inn, mu, curv + shifts[:, None, None], UB, UA, logdets, None,
                               (out, inn, out, inn), kernel, direct)
        thresh = lowrank_tol * shifts
        keep_b = int((scales[:, None] * b * a[:, -1:] >= thresh[:, None]).sum(1).max().clamp_min(1).item())
        keep_a = int((scales[:, None] * a * b[:, -1:] >= thresh[:, None]).sum(1).max().clamp_min(1).item())
        return StackedKron(offset, out * inn, mu, curv[:, -keep_b:, -keep_a:].contiguous(),
                           UB[:, :, -keep_b:].contiguous(), UA[:, :, -keep_a:].contiguous(), logdets,
                           shifts.clone(), (out, inn, keep_b, keep_a), kernel)


CHUNK_BYTES = 64 * 2**20  # working-set bound of the batched Kronecker quadratic forms (CPU)
# On a GPU each chunk costs a dozen kernel launches per block whatever its size, and memory is not
# the limit: larger chunks (measured on an H100, docs/benchmarks.md "On a GPU").
CUDA_CHUNK_BYTES = 2**30


def default_chunk_bytes(device: torch.device | str) -> int:
    """The working-set bound for tensors on ``device``: :data:`CUDA_CHUNK_BYTES` on CUDA, else :data:`CHUNK_BYTES`."""
    return CUDA_CHUNK_BYTES if torch.device(device).type == "cuda" else CHUNK_BYTES


@dataclass(frozen=True)
class StackedKron:
    """N Kronecker blocks: ``mu`` ``(N, out, in)``, rotated weights ``S`` ``(N, R1, R2)``,
    bases ``UB`` ``(N, out, R1)`` / ``UA`` ``(N, in, R2)``; ``shift`` ``(N,)`` only under the
    low-rank shortcut (its closed-form ``shift ‖W − μ‖²`` term); ``rank`` = (out, in, R1, R2).
    ``direct`` = ``(B (N, out, out), A (N, in, in), B μ, scales (N,), shifts (N,), ‖μ‖² (N,))``: the raw
    factors for the direct form (torch backend, no low-rank shortcut)."""

    offset: int
    size: int
    mu: torch.Tensor
    S: torch.Tensor
    UB: torch.Tensor
    UA: torch.Tensor
    logdets: torch.Tensor
    shift: torch.Tensor | None
    rank: tuple[int, int, int, int]
    kernel: str | None = None
    direct: tuple[torch.Tensor, ...] | None = None

    def quadratic_forms(self, w: torch.Tensor, chunk_bytes: int | None = None, form: str | None = None) -> torch.Tensor:
        """``(K, N)``, differentiable w.r.t. ``w`` (see :meth:`forms_and_vjp`)."""
        return FormsWithVJP.apply(w, self.forms_and_vjp, chunk_bytes, form)

    def forms_and_vjp(self, w: torch.Tensor, chunk_bytes: int | None = None,
                      form: str | None = None) -> tuple[torch.Tensor, VJP]:
        """``w`` ``(K, size)`` -> ``q`` ``(K, N)`` and ``vjp(grad_q (K, N)) -> (K, size)``.

        Components are processed in chunks whose ``(K, n, R1, R2)`` temporaries stay under
        ``chunk_bytes`` (default :func:`default_chunk_bytes` of ``w``'s device), so memory does not grow with N.
        ``form``: ``"direct"`` (raw factors; the default when available) or ``"rotated"``
        (eigenbases; the low-rank shortcut)."""
        K = w.shape[0]
        Wk = w.reshape(K, *self.mu.shape[1:])
        N = self.mu.shape[0]
        per = max(1, K * self.S.shape[1] * self.S.shape[2] * Wk.element_size() * 3)
        step = max(1, min(N, (default_chunk_bytes(w.device) if chunk_bytes is None else chunk_bytes) // per))
        if form is None:
            form = "direct" if self.direct is not None else "rotated"
        # component ranges of the chunks; one chunk uses the stacked tensors as they are (no slicing:
        # this runs every optimiser step)
        spans = [(i, min(i + step, N)) for i in range(0, N, step)]

        def take(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return t if (a, b) == (0, N) else t[a:b]

        if form == "direct":
            if self.direct is None:
                raise ValueError("the direct form needs the raw factors (not under the low-rank shortcut)")
            parts = [kron_direct_forms_and_vjp(Wk, take(self.mu, a, b), *(take(t, a, b) for t in self.direct[:-1]),
                                               self.kernel, take(self.direct[-1], a, b))
                     for a, b in spans]
        else:
            parts = [kron_quadratic_forms_and_vjp(Wk, *(take(t, a, b) for t in (self.mu, self.UB, self.UA, self.S)),
                                                  self.kernel)
                     for a, b in spans]
        if len(parts) == 1:
            return self._with_shift(w, *parts[0], K)
        q = torch.cat([p[0] for p in parts], dim=1)

        def chunked_vjp(g: torch.Tensor) -> torch.Tensor:
            grads = (vj(g[:, a:b].contiguous()) for (a, b), (_, vj) in zip(spans, parts))
            grad = next(grads)  # a fresh tensor: accumulated in place
            for other in grads:
                grad += other
            return grad

        return self._with_shift(w, q, chunked_vjp, K)

    def _with_shift(self, w: torch.Tensor, q: torch.Tensor, vjp: VJP, K: int) -> tuple[torch.Tensor, VJP]:
        """``(q, vjp)`` of the blocks' products, reshaped to ``(K, size)`` gradients, plus the low-rank
        shortcut's closed-form ``λ0 ‖W − μ‖²`` term when it is on."""
        if self.shift is None:
            return q, lambda g: vjp(g).reshape(K, -1)
        flat_mu = self.mu.flatten(1)  # closed-form λ0 ‖W − μ‖² of the low-rank shortcut
        q = q + self.shift[None] * (w.square().sum(1)[:, None] - 2 * w @ flat_mu.T + flat_mu.square().sum(1)[None])

        def shifted_vjp(g: torch.Tensor) -> torch.Tensor:
            gl = g * self.shift[None]  # + 2 Σ_n g λ (w − μ_n)
            return vjp(g).reshape(K, -1) + 2 * (gl.sum(1, keepdim=True) * w - gl @ flat_mu)

        return q, shifted_vjp

    def to(self, device) -> StackedKron:
        return map_tensors(self, lambda t: t.to(device))
