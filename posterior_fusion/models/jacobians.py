"""One forward pass and a batched backward pass to the layer *outputs* of a model (no weight
gradients), for the capture's GGN columns and for the logit Jacobians of the linearised predictive.

For a batch of M inputs with logits f ``(M, C)`` and probabilities p, :func:`backprop_columns` gives
the columns that are back-propagated: a square root of the cross-entropy Hessian (exact GGN, C − 1
columns), one sampled ``p − e_ŷ`` (MC Fisher), or the C unit vectors (:data:`JACOBIAN`: the logit
Jacobian itself). :func:`logit_jacobians` yields every parameter's Jacobian ``∂f_c(x_n)/∂θ``, a
Linear/Conv2d weight's kept as its two factors (:class:`FactoredJacobian`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posterior_fusion.models.layers import (
    NORM_LAYERS,
    captured_layers,
    embedding_per_sample,
    forward_with_hooks,
    input_columns,
    norm_per_sample,
    owns_curvature,
    unsupported_reason,
)


def backprop_columns(logits: torch.Tensor, ggn: str, generator: torch.Generator | None) -> torch.Tensor:
    """Back-propagated columns ``(R, M, C)``: a square root of the CE Hessian ``H = diag(p) − p pᵀ``
    with ``R = C − 1`` columns (exact), or ``p − e_ŷ`` for one sampled label ``ŷ`` (MC).

    ``H = D (I − q qᵀ) D`` with ``q = √p`` (a unit vector) and ``D = diag(q)``, and ``I − q qᵀ`` is the
    projection onto ``q``'s complement. The Householder reflection ``Y = I − 2 u uᵀ / ‖u‖²``,
    ``u = q + e_j`` with ``j = argmax q`` (no cancellation), maps ``q`` to ``−e_j``, so its other C − 1
    columns are an orthonormal basis of that complement and ``s_i = D Y e_i`` (``i ≠ j``) satisfy
    ``Σ_i s_i s_iᵀ = H``: one back-propagated column fewer than the C columns ``√p_c (e_c − p)``."""
    p = logits.detach().softmax(-1)
    if ggn == JACOBIAN:  # the logits themselves: e_c for every sample, C columns
        M, C = p.shape
        return torch.eye(C, dtype=p.dtype, device=p.device)[:, None, :].expand(C, M, C)
    if ggn == "exact":
        M, C = p.shape
        q = p.sqrt()
        j = q.argmax(1)
        u = q.clone()
        u[torch.arange(M, device=p.device), j] += 1
        coef = 2 / u.square().sum(1)  # (M,)
        eye = torch.eye(C, dtype=p.dtype, device=p.device)
        Y = eye - coef[:, None, None] * u[:, :, None] * u[:, None, :]  # (M, C, C), symmetric: row i = column i
        keep = torch.ones(M, C, dtype=torch.bool, device=p.device)
        keep[torch.arange(M, device=p.device), j] = False
        S = (Y * q[:, None, :])[keep].reshape(M, C - 1, C)  # s_i[n] = D_n Y_n e_i, i ≠ j_n
        return S.transpose(0, 1)
    on = generator.device if generator is not None else p.device  # the same draws whatever the model's device
    y = torch.multinomial(p.to(on), 1, generator=generator).squeeze(1).to(p.device)
    return (p - F.one_hot(y, p.shape[1]).to(p.dtype)).unsqueeze(0)


JACOBIAN = "jacobian"  # :func:`backprop_columns` of the logit Jacobian (the linearised predictive), not a GGN


def jacobian_problem(model: nn.Module, example: torch.Tensor) -> str | None:
    """Why :func:`logit_jacobians` cannot serve ``model`` (None when it can): every parameter must sit
    in a layer the capture back-propagates to (Linear/Conv2d, normalisation), each run once per pass."""
    reason = unsupported_reason(model, example)
    if reason is not None:
        return reason
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)) and not owns_curvature(module):
            return f"{type(module).__name__} {name or '(model)'} has parameters outside Linear/Conv2d/normalisation layers"
    return None


class FactoredJacobian:
    """The logit Jacobian of one Linear/Conv2d weight for a batch, kept as its factors: output
    gradients ``g`` ``(M, C, O, S)`` and inputs ``u`` ``(M, I, S)`` (S positions the weight is shared
    across; 1 for a plain linear layer), ``J[n, c] = Σ_s g[n, c, :, s] u[n, :, s]ᵀ`` ``(O, I)``."""

    def __init__(self, g: torch.Tensor, u: torch.Tensor) -> None:
        self.g, self.u = g, u

    def dense(self) -> torch.Tensor:
        """``J`` ``(M, C, O·I)`` (row-major, as the parameter vector)."""
        M, C = self.g.shape[:2]
        return torch.einsum("mcos,mis->mcoi", self.g, self.u).reshape(M, C, -1)


def logit_jacobians(model: nn.Module, xb: torch.Tensor):
    """The logits ``(M, C)`` of a batch ``xb`` ``(M, ...)`` first (as ``(-1, logits)``), then the
    per-parameter Jacobians of the logits, layer by layer: yields ``(k, J)`` with ``k`` the parameter's index in ``model.parameters()`` order (increasing) and ``J``
    ``∂f_c(x_n)/∂θ_k``: a :class:`FactoredJacobian` for a Linear/Conv2d weight, else a tensor
    ``(M, C, numel)`` (a bias: the output gradients summed over positions; a normalisation layer's
    weight and bias, an embedding table: its per-sample gradients).

    One forward pass and C backward passes to the layer *outputs* (no weight gradients); a layer's
    inputs and output gradients are let go once its Jacobians are yielded. Requires
    :func:`jacobian_problem` to be None."""
    layers = captured_layers(model)
    kept: dict = {}

    def on_column(r, inputs, grads):
        kept.setdefault("inputs", inputs)
        kept.setdefault("grads", []).append(grads)

    with no_param_grads(model):
        logits = batch_pass(model, layers, xb, JACOBIAN, None, on_column)
    yield -1, logits
    inputs, cols = list(kept.pop("inputs")), [list(g) for g in kept.pop("grads")]  # cols[c][i]: layer i, class c
    starts, first = {}, 0
    for module in model.modules():
        starts[module] = first
        first += len(list(module.parameters(recurse=False)))
    M, C = xb.shape[0], len(cols)
    for i, layer in enumerate(layers):
        u = inputs[i]
        if isinstance(layer, nn.Embedding):
            parts = [torch.stack([embedding_per_sample(layer, u, g[i]) for g in cols], 1)]  # (M, C, V·D)
        elif isinstance(layer, NORM_LAYERS):
            per_class = [norm_per_sample(layer, u, g[i]) for g in cols]  # C x [(M, k) per parameter]
            parts = [torch.stack([pc[j] for pc in per_class], 1) for j in range(len(per_class[0]))]
        else:
            if isinstance(layer, nn.Conv2d):
                X = input_columns(layer, u)
                patches = X.view(X.shape[0], M, -1).transpose(0, 1)  # (M, I, S)
                g = torch.stack([c[i] for c in cols], 1).reshape(M, C, layer.out_channels, -1)  # (M, C, O, S)
            else:  # (M, ..., I): positions in the middle dimensions
                patches = u.reshape(M, -1, u.shape[-1]).transpose(1, 2)
                g = torch.stack([c[i] for c in cols], 1).reshape(M, C, -1, layer.out_features).transpose(2, 3)
            parts = [FactoredJacobian(g, patches)]
            if layer.bias is not None:
                parts.append(g.sum(3))
        inputs[i] = None  # this layer's input and output gradients are no longer needed here
        for c in cols:
            c[i] = None
        for j, J in enumerate(parts):
            yield starts[layer] + j, J


def batch_pass(model: nn.Module, layers: list[nn.Module], xb: torch.Tensor, ggn: str,
                generator: torch.Generator | None, on_column, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One forward pass, then one backward pass per column to the layer *outputs* only (the
    graph is kept between them); calls ``on_column(r, inputs, grads)`` with the column index, the
    layers' inputs and their output gradients for that column; returns the logits (detached). (A single vmapped backward over the C columns,
    ``is_grads_batched``, is slower on the CPU: ``docs/benchmarks.md``, "Capture".)

    ``compute_dtype`` (e.g. ``torch.bfloat16``): the passes run under autocast in that type; the
    columns come from float32 probabilities, the inputs are handed on in the model's own type and the
    output gradients in the pass's (consumers widen them with :func:`widened`, the Grams chunk by chunk),
    so every factor is the exact float32/float64 sum of products of these rounded vectors (a Gram of
    rounded vectors stays positive semi-definite)."""
    low = compute_dtype is not None
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())  # the model's (xb may hold ids)
    logits, ins, outs, overwritten = _forward(model, layers, xb, compute_dtype, copy=False)
    if overwritten:  # an in-place op (ReLU(inplace=True), +=) changed a layer's input or output later: again, copied
        logits, ins, outs, _ = _forward(model, layers, xb, compute_dtype, copy=True)
    if not low:
        cols = backprop_columns(logits, ggn, generator)
        inputs = [ins[m] for m in layers]
    else:  # the loss Hessian's columns from float32 probabilities, back-propagated in the pass's type
        cols = backprop_columns(logits.float(), ggn, generator).to(logits.dtype)
        inputs = [ins[m].to(dtype) if ins[m].is_floating_point() else ins[m] for m in layers]  # ids stay ids
    targets = [outs[m] for m in layers]
    for r in range(len(cols)):
        grads = torch.autograd.grad(logits, targets, cols[r], retain_graph=r < len(cols) - 1)
        on_column(r, inputs, grads)
    return logits.detach().to(dtype)


def _forward(model: nn.Module, layers: list[nn.Module], xb: torch.Tensor, compute_dtype: torch.dtype | None,
             copy: bool) -> tuple[torch.Tensor, dict, dict, bool]:
    """The forward pass of :func:`batch_pass`: ``(logits, inputs, outputs, overwritten)`` of ``layers``, each
    output a tensor the backward passes differentiate with respect to; ``overwritten``: an in-place operation
    further on (``ReLU(inplace=True)``, ``out += x``) changed a recorded input or output (their version counters
    moved). ``copy``: the model goes on with a copy of each output and each input is kept as a copy, so no
    in-place operation can change them."""
    ins: dict[nn.Module, torch.Tensor] = {}
    outs: dict[nn.Module, torch.Tensor] = {}
    seen: dict[nn.Module, tuple[int, int]] = {}

    def hook(m, inp, out):
        ins[m] = inp[0].detach().clone() if copy else inp[0].detach()
        if not out.requires_grad:  # the first layer: its output starts the graph (no input gradients)
            out = out.detach().requires_grad_(True)
        outs[m] = out
        seen[m] = (ins[m]._version, out._version)
        return out.clone() if copy else out

    handles = [m.register_forward_hook(hook) for m in layers]
    low = compute_dtype is not None
    try:
        with torch.enable_grad(), torch.autocast(xb.device.type, dtype=compute_dtype or torch.bfloat16, enabled=low):
            logits = model(xb)
    finally:
        for h in handles:
            h.remove()
    overwritten = any((ins[m]._version, outs[m]._version) != v for m, v in seen.items())
    return logits, ins, outs, overwritten


def no_param_grads(model: nn.Module):
    """Parameters need no gradient during the capture (only layer outputs are differentiated)."""
    flags = [p.requires_grad for p in model.parameters()]

    class _Ctx:
        def __enter__(self):
            for p in model.parameters():
                p.requires_grad_(False)

        def __exit__(self, *exc):
            for p, f in zip(model.parameters(), flags):
                p.requires_grad_(f)

    return _Ctx()


def output_bytes(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Bytes of every leaf module's output for the input ``x`` (one forward pass without gradients)."""
    sizes: list[int] = []
    forward_with_hooks(model, [m for m in model.modules() if not list(m.children())], x,
                       lambda m, i, o: sizes.append(o.numel() * o.element_size() if isinstance(o, torch.Tensor) else 0))
    return sizes
