"""The fast capture for models whose parameters all sit in ``nn.Linear`` / ``nn.Conv2d``,
normalisation layers and per-sample embeddings: the same quantities as laplace-torch (:mod:`.laplace`, the test oracle),
computed with one forward pass per batch and one batched backward pass to the layer *outputs*.

- exact GGN: C − 1 columns of a cross-entropy Hessian square root are back-propagated; MC Fisher:
  one column ``p − e_ŷ`` per sample, ``ŷ ~ Categorical(p)`` (:func:`~posterior_fusion.models.jacobians.backprop_columns`).
- K-FAC ("expand", laplace-torch's convention): for a layer with inputs u ``(M, S, I)`` (S
  spatial positions, unfolded patches for a convolution) and output gradients g ``(R, M, S, O)``:
  A = Σ uuᵀ / (N·S), B = Σ ggᵀ, weight block ``Kron(B, A)``, bias block ``Dense(B)`` (N: the
  silo's size); "reduce" sums each sample's positions first (Eschenhagen et al. 2023), except for attention key
  projections, taken with expand (:func:`~posterior_fusion.local.capture.policy.expanded_under_reduce`).
- diagonal: per-sample gradients per column, squared and summed (Linear: Σ g² ⊗ u² without
  forming them).
- last layer full: Σ_n H_n ⊗ φ̃_n φ̃_nᵀ in closed form, H_n = diag(p_n) − p_n p_nᵀ, φ̃ = [φ; 1].
"""

from __future__ import annotations

import torch
from torch import nn

from posterior_fusion.choices import KFAC_TYPES
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron, Precision
from posterior_fusion.local.capture.gram import float64_gram
from posterior_fusion.local.capture.inputs import input_gram, reduced_input
from posterior_fusion.local.capture.outputs import output_gram, per_sample_grads, reduced_grad
from posterior_fusion.local.capture.policy import block_policy, expanded_under_reduce
from posterior_fusion.local.capture.residual import residual_diagonal, residual_names
from posterior_fusion.local.capture.sizing import pass_size
from posterior_fusion.models.jacobians import batch_pass, no_param_grads
from posterior_fusion.models.layers import (
    DIAG_LAYERS,
    SUPPORTED_LAYERS,
    captured_layers,
    diag_squares,
    input_columns,
    widened,
)
from posterior_fusion.models.maxpool import fast_max_pooling
from posterior_fusion.progress import progress


def _loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, desc: str):
    """Consecutive slices (views) of ``x`` and ``y`` with progress (a ``DataLoader`` would index and
    re-stack every sample)."""
    n = len(x)
    batches = ((x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size))
    return progress(batches, desc, -(-n // batch_size))


def fast_kron(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256, ggn: str = "exact",
              generator: torch.Generator | None = None, kfac: str = "expand",
              compute_dtype: torch.dtype | None = None) -> BlockDiag:
    """K-FAC GGN as laplace-torch's curvlinops backend: ``Kron(B, A)`` per Linear/Conv2d weight,
    ``Dense(B)`` per bias, a ``Diag`` per normalisation-layer parameter or embedding table and a zero ``Diag`` (the prior
    alone) for any other parameter (:func:`block_policy`).

    ``kfac="expand"``: A = Σ uuᵀ / (N·S) and B = Σ ggᵀ over samples *and* shared positions;
    ``"reduce"`` (Eschenhagen et al. 2023): A = Σ_n ū_n ū_nᵀ / N with ū the patches' mean over the S
    positions and B = Σ_n ĝ_n ĝ_nᵀ with ĝ the output gradient summed over them (curvlinops'
    conventions; both equal for layers without weight sharing). ``compute_dtype``: the passes' type
    (:func:`batch_pass`; None: the model's)."""
    if kfac not in KFAC_TYPES:
        raise ValueError(f"unknown K-FAC type {kfac!r}; use one of {', '.join(KFAC_TYPES)}")
    layers = captured_layers(model)
    n = x.shape[0]
    A: list = [0.0] * len(layers)
    B: list = [0.0] * len(layers)
    D: dict[int, list] = {}  # normalisation layers, embeddings: squared per-sample gradients, one sum per parameter
    expanded = expanded_under_reduce(model) if kfac == "reduce" else set()  # key projections: expand

    def on_column(r, inputs, grads):
        for i, (layer, u, g) in enumerate(zip(layers, inputs, grads)):
            if isinstance(layer, DIAG_LAYERS):
                parts = diag_squares(layer, u, widened(g))
                D[i] = parts if i not in D else [d + p for d, p in zip(D[i], parts)]
            elif kfac == "reduce" and layer not in expanded:
                G = reduced_grad(layer, widened(g))
                B[i] = B[i] + float64_gram(G.T)
                if r == 0:
                    A[i] = A[i] + float64_gram(reduced_input(layer, u).T) / n
            else:
                B[i] = B[i] + output_gram(layer, g)
                if r == 0:  # A depends on the inputs only: once per batch (mean over positions)
                    gram, positions = input_gram(layer, u)
                    A[i] = A[i] + gram / (n * positions)

    with no_param_grads(model):
        for xb, _ in _loader(x, y, pass_size(model, x, batch_size), "curvature"):
            batch_pass(model, layers, xb, ggn, generator, on_column, compute_dtype)
    blocks = kron_blocks(model, layers, A, B, D)
    residual = residual_blocks(model, x, "kron", kfac, batch_size, ggn, generator)
    if not residual:
        return blocks
    names = [n for n, _ in model.named_parameters()]
    return BlockDiag([Diag(residual[n].to(b.diagonal().dtype)) if n in residual else b
                      for n, b in zip(names, blocks.blocks)])


def residual_blocks(model: nn.Module, x: torch.Tensor, structure: str, kfac: str, batch_size: int, ggn: str,
                    generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """The GGN diagonal of every parameter no layer rule covers (:mod:`.residual`), on the CPU."""
    names = residual_names(model, block_policy(model, structure, kfac))
    found = residual_diagonal(model, x, names, min(batch_size, 64), ggn, generator)
    return {k: v.cpu() for k, v in found.items()}


def kron_blocks(model: nn.Module, layers: list[nn.Module], A: list, B: list, D: dict | list) -> BlockDiag:
    """The K-FAC precision's blocks in ``model.parameters()`` order from per-layer results (``layers``: the
    captured layers, indexing ``A``, ``B``, ``D``): ``Kron(B, A)`` per Linear/Conv2d weight and ``Dense(B)`` per
    bias, a ``Diag`` per parameter of a normalisation layer or embedding (``D[i]``: one tensor per parameter), a
    zero ``Diag`` (the prior alone) for any other parameter; on the CPU, in each parameter's type."""
    own = {layer: i for i, layer in enumerate(layers)}
    blocks: list[Precision] = []
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        i = own.get(module)
        if i is not None and isinstance(module, SUPPORTED_LAYERS):
            a, b = A[i].to("cpu", module.weight.dtype), B[i].to("cpu", module.weight.dtype)
            blocks.append(Kron(b, a))
            if module.bias is not None:
                blocks.append(Dense(b.clone()))
        elif i is not None:
            blocks.extend(Diag(d.reshape(-1).to("cpu", p.dtype)) for d, p in zip(D[i], params))
        else:
            blocks.extend(Diag(torch.zeros(p.numel(), dtype=p.dtype)) for p in params)
    return BlockDiag(blocks)


def fast_diag_vector(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256,
                     ggn: str = "exact", generator: torch.Generator | None = None,
                     compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Diagonal of the GGN (or MC Fisher) ``(d,)`` in ``model.parameters()`` order (zero for the
    parameters :func:`block_policy` gives the prior alone); ``compute_dtype`` as :func:`fast_kron`."""
    layers = captured_layers(model)
    sums: dict[int, list] = {}  # per captured layer: one float64 sum of squared per-sample gradients per parameter

    squared: dict[int, torch.Tensor] = {}  # per batch: u² (linear) or the input patches (weight sharing)

    def add(i: int, parts: list[torch.Tensor]) -> None:
        sums[i] = parts if i not in sums else [s + p for s, p in zip(sums[i], parts)]

    def on_column(r, inputs, grads):
        for i, (layer, u, g) in enumerate(zip(layers, inputs, map(widened, grads))):
            if isinstance(layer, DIAG_LAYERS):
                add(i, diag_squares(layer, u, g))
            elif isinstance(layer, nn.Linear) and u.ndim == 2:  # per-sample gradient g uᵀ: square = g² (u²)ᵀ
                if r == 0:
                    squared[i] = u.double() ** 2
                g2 = g.double() ** 2
                add(i, [g2.T @ squared[i], g2.sum(0)])
            else:  # weight sharing: per-sample gradients summed over positions, then squared
                if r == 0:
                    X = input_columns(layer, u)  # (I, M·S) -> per-sample patches (M, I, S), a view
                    squared[i] = X.view(X.shape[0], u.shape[0], -1).transpose(0, 1)
                pw, pb = per_sample_grads(layer, squared[i], g)
                add(i, [(pw * pw).sum(0, dtype=torch.float64), (pb * pb).sum(0, dtype=torch.float64)])

    with no_param_grads(model):
        for xb, _ in _loader(x, y, pass_size(model, x, batch_size), "curvature"):
            batch_pass(model, layers, xb, ggn, generator, on_column, compute_dtype)
    own = {layer: i for i, layer in enumerate(layers)}
    parts = []
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        i = own.get(module)
        if i is None or not params:
            parts.extend(torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params)
        elif isinstance(module, SUPPORTED_LAYERS):
            parts.append(sums[i][0].reshape(-1).to(module.weight.dtype))
            if module.bias is not None:
                parts.append(sums[i][1].to(module.weight.dtype))
        else:
            parts.extend(d.reshape(-1).to(p.dtype) for d, p in zip(sums[i], params))
    return torch.cat(parts).cpu()


def with_residual(model: nn.Module, g: torch.Tensor, x: torch.Tensor, structure: str, batch_size: int, ggn: str,
                  generator: torch.Generator | None) -> torch.Tensor:
    """The diagonal ``g`` ``(d,)`` with the parameters no layer rule covers given their GGN diagonal."""
    residual = residual_blocks(model, x, structure, "expand", batch_size, ggn, generator)
    if not residual:
        return g
    g = g.clone()
    offset = 0
    for name, p in model.named_parameters():
        if name in residual:
            g[offset: offset + p.numel()] = residual[name].to(g.dtype)
        offset += p.numel()
    return g


def fast_diag(model, x, y, batch_size=256, ggn="exact", generator=None, compute_dtype=None) -> BlockDiag:
    g = fast_diag_vector(model, x, y, batch_size, ggn, generator, compute_dtype)
    return BlockDiag([Diag(with_residual(model, g, x, "diag", batch_size, ggn, generator))])


def last_layer_ggn(model: nn.Module, x: torch.Tensor, batch_size: int = 256,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Exact GGN of the last ``nn.Linear`` (weight row-major, then bias): Σ_n w_n H_n ⊗ φ̃_n φ̃_nᵀ
    ``(O·I + O, O·I + O)``, with φ the layer's input, H_n the CE Hessian at the logits and ``weights`` ``(n,)``
    per-sample weights w_n (None: 1)."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    feats: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda m, i, o: feats.append(i[0].detach()))
    n_out, n_in = last.weight.shape
    has_b = last.bias is not None
    k = n_in + 1 if has_b else n_in
    first = torch.zeros(n_out, k, k, dtype=torch.float64, device=x.device)
    second = torch.zeros(n_out * k, n_out * k, dtype=torch.float64, device=x.device)
    try:
        with torch.no_grad(), fast_max_pooling(model):
            start = 0
            for xb, _ in _loader(x, x.new_zeros(len(x)), batch_size, "curvature (last layer)"):
                feats.clear()
                p = model(xb).softmax(-1)
                phi = feats[0].reshape(len(xb), -1)
                if has_b:
                    phi = torch.cat([phi, phi.new_ones(len(phi), 1)], 1)
                if weights is not None:  # w_n H_n ⊗ φ̃_n φ̃_nᵀ = H_n ⊗ (√w_n φ̃_n)(√w_n φ̃_n)ᵀ
                    phi = phi * weights[start: start + len(xb)].to(phi).sqrt()[:, None]
                start += len(xb)
                # per-batch products in the model's dtype (sums of ≤ batch_size terms), accumulated in float64
                first += torch.einsum("no,ni,nj->oij", p, phi, phi).double()
                v = p.unsqueeze(2) * phi.unsqueeze(1)  # (n, O, k): p_n ⊗ φ̃_n
                vf = v.reshape(len(xb), -1)
                for o in range(n_out):  # upper block triangle only: Σ (p pᵀ) ⊗ (φ̃ φ̃ᵀ) is symmetric in (o, o')
                    second[o * k : (o + 1) * k, o * k :] += (v[:, o].T @ vf[:, o * k :]).double()
    finally:
        handle.remove()
    diagonal = torch.block_diag(*[second[o * k : (o + 1) * k, o * k : (o + 1) * k] for o in range(n_out)])
    second = second + second.T - diagonal  # the lower block triangle mirrored from the upper
    H = (torch.block_diag(*first) - second).to("cpu", last.weight.dtype)  # index (o, i), i < k
    if not has_b:
        return H
    idx = torch.arange(n_out * k).reshape(n_out, k)
    order = torch.cat([idx[:, :n_in].reshape(-1), idx[:, n_in]])  # weights row-major, then the bias
    return H[order][:, order]


def fast_diag_full(model, x, y, batch_size=256, ggn="exact", generator=None, compute_dtype=None) -> BlockDiag:
    """Diagonal GGN for all but the last layer (passes in ``compute_dtype``), exact full GGN block of
    the last ``nn.Linear`` (closed form, in the model's type)."""
    g = with_residual(model, fast_diag_vector(model, x, y, batch_size, ggn, generator, compute_dtype), x, "diag+full",
                      batch_size, ggn, generator)
    H = last_layer_ggn(model, x, batch_size)
    p = H.shape[0]
    return BlockDiag([Diag(g[:-p]), Dense(0.5 * (H + H.T))])


FAST_CAPTURE = {"kron": fast_kron, "diag": fast_diag, "diag+full": fast_diag_full}
