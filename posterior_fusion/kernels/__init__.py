"""Batched Kronecker quadratic forms with one dispatch API (used by ``fuse``).

:func:`kron_quadratic_forms` evaluates, for K points and all N stacked components of one
layer at once (no Python loop over components), ``q[k, n] = Σ (UB[n]ᵀ (W[k] − mu[n]) UA[n])² ∘ S[n]``
and is differentiable w.r.t. ``W`` through :class:`KronQuadraticForms`.

The fusion uses the *direct form* :func:`kron_direct_forms` (raw factors, no rotation; torch
reuses the product for the gradient, Triton computes the gradient in one fused pass instead of
two: half the FLOPs either way); the rotated form stays for the low-rank shortcut.

Backends: ``"torch"`` (batched matmuls, :mod:`.reference`; CPU default and test oracle) and
``"triton"`` (fused kernels, :mod:`.triton_kron`; default for CUDA tensors when Triton is
installed — ``pip install posterior-fusion[gpu]``). ``$PFUSE_KERNEL`` forces one; Triton on
the CPU needs ``TRITON_INTERPRET=1`` (slow, for tests).
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch.autograd.function import once_differentiable

from posterior_fusion.errors import ConfigError
from posterior_fusion.kernels import reference

BACKENDS = ("torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_backend(W: torch.Tensor, backend: str | None = None) -> str:
    """Explicit ``backend``, else ``$PFUSE_KERNEL``, else triton on CUDA when installed, else torch."""
    backend = backend or os.environ.get("PFUSE_KERNEL") or ("triton" if W.is_cuda and triton_available() else "torch")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown kernel backend {backend!r}; use one of {BACKENDS}")
    if backend == "triton":
        if not triton_available():
            raise ConfigError("kernel backend 'triton' needs Triton (pip install 'posterior-fusion[gpu]')")
        if not W.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("Triton on CPU tensors needs TRITON_INTERPRET=1 (test mode); use backend 'torch'")
    return backend


class KronQuadraticForms(torch.autograd.Function):
    """``q (K, N)`` from ``W (K, P, Q)``; gradient w.r.t. ``W`` only (the rest are constants)."""

    @staticmethod
    def forward(ctx, W, mu, UB, UA, S, backend):  # noqa: D102
        ctx.backend = backend
        if backend == "triton":
            from posterior_fusion.kernels import triton_kron

            q = triton_kron.quadratic_forms(W, mu, UB, UA, S)
            ctx.save_for_backward(W, mu, UB, UA, S)
        else:
            q, Z = reference.quadratic_forms(W, mu, UB, UA, S)
            ctx.save_for_backward(Z, UB, UA, S)
        return q

    @staticmethod
    @once_differentiable  # no double backward: a Hessian through this Function must fail loudly, not be wrong
    def backward(ctx, grad_q):  # noqa: D102
        if ctx.backend == "triton":
            from posterior_fusion.kernels import triton_kron

            W, mu, UB, UA, S = ctx.saved_tensors
            grad = triton_kron.quadratic_forms_grad(W, mu, UB, UA, S, grad_q)
        else:
            Z, UB, UA, S = ctx.saved_tensors
            grad = reference.quadratic_forms_grad(Z, UB, UA, S, grad_q)
        return grad, None, None, None, None, None


class KronDirectForms(torch.autograd.Function):
    """The direct form (:func:`reference.direct_forms`) as a Function: ``q (K, N)`` from ``W``;
    gradient w.r.t. ``W`` only. Torch keeps ``M = B V A`` for the gradient; Triton recomputes it
    in one fused pass."""

    @staticmethod
    def forward(ctx, W, mu, B, A, Bmu, scale, shift, mu_sq, backend):  # noqa: D102
        ctx.backend = backend
        if backend == "triton":
            from posterior_fusion.kernels import triton_kron

            q = triton_kron.direct_forms(W, mu, B, A, scale, shift)
            ctx.save_for_backward(W, mu, B, A, scale, shift)
        else:
            q, M = reference.direct_forms(W, mu, B, A, Bmu, scale, shift, mu_sq)
            ctx.save_for_backward(W, mu, M, scale, shift)
        return q

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q):  # noqa: D102
        if ctx.backend == "triton":
            from posterior_fusion.kernels import triton_kron

            W, mu, B, A, scale, shift = ctx.saved_tensors
            grad = triton_kron.direct_forms_grad(W, mu, B, A, scale, shift, grad_q)
        else:
            W, mu, M, scale, shift = ctx.saved_tensors
            grad = reference.direct_forms_grad(W, mu, M, scale, shift, grad_q)
        return grad, None, None, None, None, None, None, None, None


def kron_direct_forms(W: torch.Tensor, mu: torch.Tensor, B: torch.Tensor, A: torch.Tensor, Bmu: torch.Tensor,
                      scale: torch.Tensor, shift: torch.Tensor, backend: str | None = None,
                      mu_sq: torch.Tensor | None = None) -> torch.Tensor:
    """``(K, N)`` quadratic forms from the raw factors (see :func:`reference.direct_forms`)."""
    return KronDirectForms.apply(W.contiguous(), mu, B, A, Bmu, scale, shift, mu_sq, choose_backend(W, backend))


def kron_quadratic_forms(W: torch.Tensor, mu: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor, S: torch.Tensor,
                         backend: str | None = None) -> torch.Tensor:
    """``(K, N)`` quadratic forms (see module docstring); differentiable w.r.t. ``W``."""
    return KronQuadraticForms.apply(W.contiguous(), mu, UB, UA, S, choose_backend(W, backend))


__all__ = ["kron_quadratic_forms", "KronQuadraticForms", "kron_direct_forms", "KronDirectForms", "choose_backend",
           "triton_available", "BACKENDS"]
