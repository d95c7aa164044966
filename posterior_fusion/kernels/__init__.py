"""Batched Kronecker quadratic forms with one dispatch API (used by ``fuse``).

:func:`kron_quadratic_forms` evaluates, for K points and all N stacked components of one
layer at once (no Python loop over components), ``q[k, n] = Σ (UB[n]ᵀ (W[k] − mu[n]) UA[n])² ∘ S[n]``
and is differentiable w.r.t. ``W`` through :class:`FormsWithVJP`; the ``*_and_vjp`` variants
return the forms with their vector-Jacobian product instead of an autograd graph (the fedbens
objective's path: no graph, no Function overhead per block).

The fusion uses the *direct form* :func:`kron_direct_forms` (raw factors, no rotation; torch
reuses the product for the gradient, Triton computes the gradient in one fused pass instead of
two: half the FLOPs either way); the rotated form stays for the low-rank shortcut.

Backends: ``"torch"`` (batched matmuls, :mod:`.reference`; the default on CPU and GPU, and the
test oracle) and ``"triton"`` (fused kernels, :mod:`.triton_kron`, opt-in — ``pip install
posterior-fusion[gpu]``: they never form the ``(K, N, P, Q)`` products, so they need a tenth of the
GPU memory, but they are slower than torch's cuBLAS products — a tile recomputes ``B V`` for every
column block; measured in ``docs/benchmarks.md``, "On a GPU"). ``$PFUSE_KERNEL`` forces one; Triton
on the CPU needs ``TRITON_INTERPRET=1`` (slow, for tests).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from posterior_fusion.choices import KERNELS
from posterior_fusion.environment import environment
from posterior_fusion.errors import ConfigError
from posterior_fusion.kernels import reference

BACKENDS = KERNELS


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_backend(W: torch.Tensor, backend: str | None = None) -> str:
    """Explicit ``backend``, else ``$PFUSE_KERNEL``, else torch (on a GPU too: see the module docstring)."""
    backend = backend or environment("PFUSE_KERNEL") or "torch"
    if backend not in BACKENDS:
        raise ConfigError(f"unknown kernel backend {backend!r}; use one of {BACKENDS}")
    if backend == "triton":
        if not triton_available():
            raise ConfigError("kernel backend 'triton' needs Triton (pip install 'posterior-fusion[gpu]')")
        if not W.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("Triton on CPU tensors needs TRITON_INTERPRET=1 (test mode); use backend 'torch'")
    return backend


VJP = Callable[[torch.Tensor], torch.Tensor]


def kron_quadratic_forms_and_vjp(W: torch.Tensor, mu: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor,
                                 S: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, VJP]:
    """Rotated form: ``q (K, N)`` and ``vjp(grad_q (K, N)) -> (K, P, Q)``, the gradient of
    ``Σ grad_q ∘ q`` w.r.t. ``W`` (no autograd graph; torch keeps ``Z``, Triton recomputes)."""
    backend = choose_backend(W, backend)
    W = W.contiguous()
    if backend == "triton":
        from posterior_fusion.kernels import triton_kron

        q = triton_kron.quadratic_forms(W, mu, UB, UA, S)
        return q, lambda g: triton_kron.quadratic_forms_grad(W, mu, UB, UA, S, g)
    q, Z = reference.quadratic_forms(W, mu, UB, UA, S)
    return q, lambda g: reference.quadratic_forms_grad(Z, UB, UA, S, g)


def kron_direct_forms_and_vjp(W: torch.Tensor, mu: torch.Tensor, B: torch.Tensor, A: torch.Tensor,
                              Bmu: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                              backend: str | None = None, mu_sq: torch.Tensor | None = None) -> tuple[torch.Tensor, VJP]:
    """Direct form (:func:`reference.direct_forms`): ``q (K, N)`` and ``vjp(grad_q (K, N)) -> (K, P, Q)``.
    Torch keeps ``M = B V A`` for the gradient; Triton recomputes it in one fused pass."""
    backend = choose_backend(W, backend)
    W = W.contiguous()
    if backend == "triton":
        from posterior_fusion.kernels import triton_kron

        q = triton_kron.direct_forms(W, mu, B, A, scale, shift)
        return q, lambda g: triton_kron.direct_forms_grad(W, mu, B, A, scale, shift, g)
    q, M = reference.direct_forms(W, mu, B, A, Bmu, scale, shift, mu_sq)
    return q, lambda g: reference.direct_forms_grad(W, mu, M, scale, shift, g)


class FormsWithVJP(torch.autograd.Function):
    """``q (K, N)`` from ``W`` through a ``*_and_vjp`` function; gradient w.r.t. ``W`` only (the
    rest are constants). Once differentiable: a Hessian through it must fail loudly, not be wrong."""

    @staticmethod
    def forward(ctx, W, forms_and_vjp, *args):  # noqa: D102
        q, ctx.vjp = forms_and_vjp(W, *args)
        ctx.nargs_tail = len(args)
        return q

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q):  # noqa: D102
        return (ctx.vjp(grad_q.contiguous()), None) + (None,) * ctx.nargs_tail


def kron_direct_forms(W: torch.Tensor, mu: torch.Tensor, B: torch.Tensor, A: torch.Tensor, Bmu: torch.Tensor,
                      scale: torch.Tensor, shift: torch.Tensor, backend: str | None = None,
                      mu_sq: torch.Tensor | None = None) -> torch.Tensor:
    """``(K, N)`` quadratic forms from the raw factors (see :func:`reference.direct_forms`);
    differentiable w.r.t. ``W``."""
    return FormsWithVJP.apply(W, kron_direct_forms_and_vjp, mu, B, A, Bmu, scale, shift, backend, mu_sq)


def kron_quadratic_forms(W: torch.Tensor, mu: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor, S: torch.Tensor,
                         backend: str | None = None) -> torch.Tensor:
    """``(K, N)`` quadratic forms (see module docstring); differentiable w.r.t. ``W``."""
    return FormsWithVJP.apply(W, kron_quadratic_forms_and_vjp, mu, UB, UA, S, backend)


__all__ = ["kron_quadratic_forms", "kron_quadratic_forms_and_vjp", "kron_direct_forms", "kron_direct_forms_and_vjp",
           "FormsWithVJP", "VJP", "choose_backend", "triton_available", "BACKENDS"]
