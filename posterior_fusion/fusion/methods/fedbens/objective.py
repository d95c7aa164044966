"""The negative global log posterior FedBEns minimises, evaluated in chunks of clients with its
gradient formed in the forward pass (a custom autograd function), so peak memory does not grow
with the number of clients."""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.fusion.block_stacks import default_chunk_bytes
from posterior_fusion.fusion.gaussian_stack import StackedGaussians
from posterior_fusion.kernels.graphs import GraphedStep
from posterior_fusion.mixture import LOG_2PI, gaussian_log_norm


class GlobalLogPosterior:
    """Negative global log posterior ``−log p(w | D)`` (up to a constant) for ``W`` ``(K, d)``.

    Clients are evaluated in chunks of whole clients whose working set (about ``3·K·d`` numbers
    per component) stays under ``chunk_bytes`` (default: the device's
    :func:`~posterior_fusion.fusion.block_stacks.default_chunk_bytes`, 64 MiB on a CPU; 0 = every client at
    once). Each chunk's log-sum-exp and its gradient are computed before the next chunk starts and
    only the ``(K, d)`` gradient is kept for the backward pass, so peak memory does not grow with the
    number of clients and no product is computed twice (autograd through the whole sum would keep
    every component's ``B V A`` until the backward pass). On CUDA, ``cuda_graphs`` (default on)
    replays each step with a gradient from a captured CUDA graph.

    ``prior_centres`` ``(K, d)``: the over-counted prior is divided out at row k's centre
    (``−½ (Σ λ_c − λ0) ‖w_k − μ_k‖²``) instead of at zero; the objective is then evaluated on
    exactly K rows, row k against μ_k."""

    def __init__(self, clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                 server_prior_precision: float, dtype: torch.dtype = torch.float32, spectral_cutoff: float = 0.0,
                 kernel: str | None = None, device: str = "cpu", chunk_bytes: int | None = None,
                 cuda_graphs: bool = True, show_progress: bool = True,
                 prior_centres: torch.Tensor | None = None) -> None:
        comps, scales, shifts, self.groups = [], [], [], []
        for c, t, lam in zip(clients, temperatures, prior_precisions):
            start = len(comps)
            comps.extend(c.components)
            scales.extend([1.0 / t] * c.num_components)
            shifts.extend([lam] * c.num_components)
            self.groups.append((start, len(comps)))
        self.stack = StackedGaussians(comps, scales, shifts, dtype, spectral_cutoff, kernel, show_progress).to(device)
        d = self.stack.dim
        self.d = d
        log_pi = torch.cat([torch.log(c.weights).to(dtype) for c in clients])
        # Normalised log N(w; ŵ, Λ⁻¹) = log π + ½ log|Λ| − d/2 log 2π − ½ q
        self.log_norm = log_pi.to(device) + gaussian_log_norm(self.stack.logdets, d)  # (N,)
        # The prior correction  Σ_c log N(w; 0, λ_c⁻¹ I) − log N(w; 0, λ0⁻¹ I) = const − ½ (Σ λ_c − λ0) ‖w‖²
        lam_sum, lam0 = math.fsum(prior_precisions), float(server_prior_precision)
        self.prior_const = 0.5 * d * (sum(math.log(lam) for lam in prior_precisions) - math.log(lam0)
                                      - (len(prior_precisions) - 1) * LOG_2PI)
        self.prior_slope = lam_sum - lam0  # the correction's gradient is −(Σ λ_c − λ0) (w − μ)
        self.prior_centres = None if prior_centres is None else prior_centres.to(device=device, dtype=dtype)
        self.chunk_bytes = default_chunk_bytes(device) if chunk_bytes is None else chunk_bytes
        self._chunks: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
        # each component's client (index into the clients): the per-client softmax of ragged clients
        self.client_of = torch.tensor([i for i, (a, b) in enumerate(self.groups) for _ in range(a, b)], device=device)
        # on a GPU the step is bound by kernel launches: replay it as one CUDA graph
        self._graphed = GraphedStep(self._value_and_gradient) if cuda_graphs and torch.device(device).type == "cuda" else None

    def chunks(self, K: int, element_size: int) -> list[list[tuple[int, int]]]:
        """The client groups ``(start, stop)`` evaluated together for ``K`` points (remembered per
        ``(K, element_size)``: this runs every optimiser step)."""
        key = (K, element_size)
        if key not in self._chunks:
            self._chunks[key] = self._make_chunks(K, element_size)
        return self._chunks[key]

    def _make_chunks(self, K: int, element_size: int) -> list[list[tuple[int, int]]]:
        per_component = 3 * K * self.d * element_size
        out: list[list[tuple[int, int]]] = [[]]
        used = 0
        for a, b in self.groups:
            cost = (b - a) * per_component
            if out[-1] and self.chunk_bytes > 0 and used + cost > self.chunk_bytes:
                out.append([])
                used = 0
            out[-1].append((a, b))
            used += cost
        return out

    def value_and_gradient(self, W: torch.Tensor, gradient: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``W`` ``(K, d)`` -> values ``(K,)`` of ``−log p(w | D)`` and, with ``gradient``, their
        gradients ``(K, d)`` (row k is ``∂ value_k / ∂ W_k``; the rows are independent).

        No autograd: each block returns its forms with their vector-Jacobian product
        (:meth:`StackedGaussians.forms_and_vjp`), so the gradient reuses the forward products
        and costs no graph (at C = 5, M = 1 the graph and Function calls were ~1/3 of a step).
        On CUDA the step (with ``gradient``) is replayed from a captured CUDA graph
        (:class:`~posterior_fusion.kernels.graphs.GraphedStep`)."""
        W = W.detach()
        if gradient and self._graphed is not None:  # eager for CPU tensors
            return self._graphed(W)
        return self._value_and_gradient(W, gradient)

    def _value_and_gradient(self, W: torch.Tensor, gradient: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`value_and_gradient`, eagerly (no host synchronisation: it may be captured as a CUDA graph)."""
        K = W.shape[0]
        D = W
        if self.prior_centres is not None:
            if self.prior_centres.shape != W.shape:  # a caller's bug, not a user's input
                raise ValueError(f"{tuple(W.shape)} points against {tuple(self.prior_centres.shape)} prior centres")
            D = W - self.prior_centres
        values = D.square().sum(-1).mul_(-0.5 * self.prior_slope).add_(self.prior_const)  # the prior correction
        grad = None
        for chunk in self.chunks(K, W.element_size()):
            first, last = chunk[0][0], chunk[-1][1]
            stack = self.stack if (first, last) == (0, self.stack.num) else self.stack.select(first, last)
            q, vjp = stack.forms_and_vjp(W)  # (K, n), no autograd graph
            log_comp = torch.add(self.log_norm[first:last], q, alpha=-0.5)
            sizes = [b - a for a, b in chunk]
            if len(set(sizes)) == 1:  # every client has the same number of components: one reshape
                per_client = log_comp.view(K, len(chunk), sizes[0])
                lse = torch.logsumexp(per_client, dim=-1)  # (K, C')
                r = per_client.sub_(lse[..., None]).exp_().view(K, -1) if gradient else None
            else:
                lse = torch.stack([torch.logsumexp(log_comp[:, a - first : b - first], -1) for a, b in chunk], 1)
                own = self.client_of[first:last] - self.client_of[first]  # each component's client in the chunk
                r = log_comp.sub_(lse.index_select(1, own)).exp_() if gradient else None
            values -= lse.sum(1)
            if gradient:  # ∂/∂W Σ_c lse_c = Σ_n r_n · (−½ ∂q_n/∂W), r = each client's softmax
                part = vjp(r)
                grad = part if grad is None else grad.add_(part)
        if grad is not None:  # ½ Σ r ∂q/∂W, then the prior correction's −(Σ λ_c − λ0) (w − μ)
            grad.mul_(0.5).add_(D, alpha=-self.prior_slope)
        return values, grad

    def __call__(self, W: torch.Tensor) -> torch.Tensor:
        """``(K, d)`` -> ``(K,)`` values of ``−log p(w | D)``, differentiable w.r.t. ``W`` (once)."""
        if torch.is_grad_enabled() and W.requires_grad:
            return _NegLogPosterior.apply(W, self)
        return self.value_and_gradient(W, gradient=False)[0]


class _NegLogPosterior(torch.autograd.Function):
    """:meth:`GlobalLogPosterior.value_and_gradient` as a Function: the gradient is computed in the
    forward pass, chunk by chunk, and only scaled in the backward pass."""

    @staticmethod
    def forward(ctx, W, objective):  # noqa: D102
        values, grad = objective.value_and_gradient(W)
        ctx.save_for_backward(grad)
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_values):  # noqa: D102
        (grad,) = ctx.saved_tensors
        return grad_values[:, None] * grad, None
