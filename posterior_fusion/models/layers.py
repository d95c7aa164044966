"""What a layer is to the curvature code: which modules own curvature (``nn.Linear`` /
``nn.Conv2d`` weights and biases; GroupNorm / LayerNorm / BatchNorm in evaluation mode, their affine
parameters; an ``nn.Embedding`` whose input holds one row per sample, its table), which models the fast passes can serve, and how a layer's input looks to its weight
(a convolution's unfolded patches ``(I, M·S)``; a normalisation layer's per-sample affine
gradients). Shared by the silo's capture (:mod:`posterior_fusion.local.capture`) and the server's
predictive (:mod:`posterior_fusion.predictive`) through :mod:`.jacobians`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_LAYERS = (nn.Linear, nn.Conv2d)  # K-FAC blocks (weight: Kron, bias: Dense)


NORM_LAYERS = (nn.GroupNorm, nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)  # affine parameters: Diag blocks
DIAG_LAYERS = (*NORM_LAYERS, nn.Embedding)  # per-sample gradients squared: Diag blocks under every structure

PER_SAMPLE = "pfuse_per_sample"  # an nn.Embedding's flag: its input holds one row per sample (set by :func:`unsupported_reason`)


def conv_problem(module: nn.Module) -> str | None:
    if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"
                                          or isinstance(module.padding, str)):
        return "uses groups, a padding mode or string padding"
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
        return "uses max_norm or scale_grad_by_freq (its table or its gradient depend on the batch)"
    return None


def owns_curvature(module: nn.Module) -> bool:
    """Whether the fast capture back-propagates to this module's output (it owns curvature): a
    Linear/Conv2d or normalisation layer with parameters, or an ``nn.Embedding`` whose input holds one
    row per sample (flagged by :func:`unsupported_reason` on an example; an embedding of positions
    computed once for the batch is not, and stays with the prior)."""
    if isinstance(module, nn.Embedding):
        return getattr(module, PER_SAMPLE, False)
    return isinstance(module, SUPPORTED_LAYERS + NORM_LAYERS) and any(True for _ in module.parameters(recurse=False))


def forward_with_hooks(model: nn.Module, modules: list[nn.Module], batch: torch.Tensor, hook) -> None:
    """One forward pass of ``batch`` without gradients with ``hook(module, inputs, output)`` (returning None) on
    each of ``modules``, removed afterwards."""
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        with torch.no_grad():
            model(batch)
    finally:
        for h in handles:
            h.remove()


def input_rows(model: nn.Module, modules: list[nn.Module], batch: torch.Tensor) -> dict[nn.Module, list[int]]:
    """For each of ``modules``, the leading size of its input at every call of one forward pass of ``batch``
    (-1 for a 0-d input; no entry when it did not run)."""
    rows: dict[nn.Module, list[int]] = {}
    forward_with_hooks(model, modules, batch,
                       lambda m, i, o: rows.setdefault(m, []).append(i[0].shape[0] if i[0].dim() else -1))
    return rows


def flag_embeddings(model: nn.Module, example: torch.Tensor) -> None:
    """Flag each ``nn.Embedding`` of ``model`` whose input holds one row per sample (:data:`PER_SAMPLE`):
    its leading size follows the batch at two batch sizes of ``example``. The layer policy's one
    decision that needs data; every capture and Jacobian path makes it through :func:`unsupported_reason`."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    follows = dict.fromkeys(embeddings, len(example) > 1)
    for batch in (example, example[:1]) if embeddings else ():
        rows = input_rows(model, embeddings, batch)
        for m in embeddings:
            follows[m] = follows[m] and rows.get(m, [None])[0] == batch.shape[0]
    for m, ok in follows.items():
        setattr(m, PER_SAMPLE, ok)


def unsupported_reason(model: nn.Module, example: torch.Tensor | None = None) -> str | None:
    """Why the fast capture cannot handle ``model`` (None when it can). With ``example`` (a
    small input batch) it also checks that every captured layer runs exactly once per forward pass.

    Layer policy (:func:`block_policy`): Linear/Conv2d K-FAC (or diagonal), GroupNorm / LayerNorm /
    BatchNorm (evaluation mode) affine parameters and a per-sample embedding table diagonal, any other
    parameter the prior alone. With ``example`` it also flags the embeddings (:func:`flag_embeddings`)."""
    for name, module in model.named_modules():
        problem = conv_problem(module)
        if problem is not None:
            return f"convolution {name} {problem}"
        if isinstance(module, NORM_LAYERS[2:]) and module.training:
            return f"{type(module).__name__} {name} is in training mode (batch statistics couple the samples)"
    if not any(isinstance(m, SUPPORTED_LAYERS) for m in model.modules()):
        return "the model has no Linear or Conv2d layer"
    if example is not None:
        flag_embeddings(model, example)
        layers = captured_layers(model)
        names = {m: n for n, m in model.named_modules()}
        for batch in (example, example[:1]):  # two batch sizes: a leading size that does not follow them is no batch
            rows = input_rows(model, layers, batch)
            if any(len(rows.get(m, ())) != 1 for m in layers):
                return "a Linear/Conv2d or normalisation layer does not run exactly once per forward pass"
            odd = next((m for m in layers if rows[m][0] != batch.shape[0]), None)
            if odd is not None:
                return (f"{type(odd).__name__} {names.get(odd, '?')}'s input does not hold one row per sample (its "
                        f"leading size is {rows[odd][0]} for a batch of {batch.shape[0]}: computed once for the batch, "
                        "or a sequence-first layout), so per-sample curvature cannot be taken there")
    return None


def captured_layers(model: nn.Module) -> list[nn.Module]:
    """The modules the capture back-propagates to, in ``model.modules()`` order."""
    return [m for m in model.modules() if owns_curvature(m)]


def normalised_input(module: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """A normalisation layer's input ``u`` normalised, before its affine map (same shape as ``u``)."""
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(u, module.num_groups, eps=module.eps)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(u, module.normalized_shape, eps=module.eps)
    return F.batch_norm(u, module.running_mean, module.running_var, training=False, eps=module.eps)


def embedding_squares(module: nn.Embedding, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``Σ_n G_n ⊙ G_n`` ``(V, D)`` (float64) for an embedding table, ``G_n = Σ_t e_{ids[n, t]} g[n, t]ᵀ`` the
    per-sample gradient, from its input ``ids`` ``(M, ...)`` and output gradient ``g`` ``(M, ..., D)``; no
    ``(M, V, D)`` tensor formed: the (sample, token) pairs that occur are summed first (``padding_idx``: no gradient)."""
    M, V = ids.shape[0], module.num_embeddings
    keys = (torch.arange(M, device=ids.device).view(M, *[1] * (ids.dim() - 1)) * V + ids).reshape(-1)
    g = g.reshape(keys.shape[0], -1).double()
    if module.padding_idx is not None:
        keep = ids.reshape(-1) != module.padding_idx
        keys, g = keys[keep], g[keep]
    pairs, where = torch.unique(keys, return_inverse=True)
    summed = g.new_zeros(pairs.shape[0], g.shape[1]).index_add_(0, where, g)
    return g.new_zeros(V, g.shape[1]).index_add_(0, pairs % V, summed * summed)


def embedding_per_sample(module: nn.Embedding, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-sample gradients ``(M, V·D)`` of an embedding table (row-major, as the parameter) from its
    input ``ids`` ``(M, ...)`` and output gradient ``g`` ``(M, ..., D)`` (``padding_idx``: no gradient)."""
    M, V = ids.shape[0], module.num_embeddings
    ids = ids.reshape(M, -1)
    g = g.reshape(M, ids.shape[1], -1)
    if module.padding_idx is not None:
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    out = g.new_zeros(M, V, g.shape[2]).scatter_add_(1, ids.unsqueeze(-1).expand_as(g), g)
    return out.reshape(M, -1)


def diag_squares(module: nn.Module, u: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """``Σ_n`` squared per-sample gradients (float64), one tensor per parameter, of a :data:`DIAG_LAYERS` module."""
    if isinstance(module, nn.Embedding):
        return [embedding_squares(module, u, g)]
    return [(t.double() ** 2).sum(0) for t in norm_per_sample(module, u, g)]


def norm_per_sample(module: nn.Module, u: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample gradients ``(M, k)`` of a normalisation layer's weight and bias (those that exist),
    from its input ``u`` and output gradient ``g``: weight Σ g ⊙ x̂, bias Σ g over the positions the
    parameter is shared across."""
    M = u.shape[0]
    xhat = normalised_input(module, u)
    if isinstance(module, nn.LayerNorm):
        k = math.prod(module.normalized_shape)
        per = lambda t: t.reshape(M, -1, k).sum(1)  # noqa: E731
    else:  # channel axis 1
        per = lambda t: t.reshape(M, t.shape[1], -1).sum(2)  # noqa: E731
    out = []
    for pname, _ in module.named_parameters(recurse=False):
        out.append(per(g * xhat) if pname == "weight" else per(g))
    return out


def kernel_windows(module: nn.Conv2d, x: torch.Tensor):
    """For each kernel offset ``(a, b)`` of a convolution, the strided view ``(M, C, Ho, Wo)`` of its
    zero-padded input ``x`` ``(M, C, H, W)`` that this offset meets at every output position."""
    (ph, pw), (sh, sw), (dh, dw) = module.padding, module.stride, module.dilation
    kh, kw = module.kernel_size
    xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    Ho, Wo = conv_output_size(module, x)
    for a in range(kh):
        for b in range(kw):
            yield a, b, xp[:, :, a * dh : a * dh + (Ho - 1) * sh + 1 : sh, b * dw : b * dw + (Wo - 1) * sw + 1 : sw]


def input_columns(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Layer input as columns ``(I, M·S)``: for a convolution the M·S patches of I values (rows ordered
    as ``F.unfold``'s (channel, kh, kw)), written by one strided copy per kernel offset (long runs of
    output positions rather than a windowed view copied patch by patch, whose inner runs are kw values;
    timings in ``docs/benchmarks.md``, "Capture"); for a linear layer a view of the inputs at every position."""
    if isinstance(module, nn.Conv2d):
        (kh, kw), (M, C), (Ho, Wo) = module.kernel_size, x.shape[:2], conv_output_size(module, x)
        out = x.new_empty(C, kh, kw, M, Ho, Wo)
        for a, b, window in kernel_windows(module, x):  # window (M, C, Ho, Wo)
            out[:, a, b] = window.transpose(0, 1)
        return out.view(C * kh * kw, M * Ho * Wo)
    return x.reshape(-1, x.shape[-1]).T


def conv_output_size(module: nn.Conv2d, x: torch.Tensor) -> tuple[int, int]:
    """Output positions of a convolution over its input ``x`` ``(M, C, H, W)`` (padding included)."""
    (ph, pw) = module.padding
    return output_size(module, x.shape[2] + 2 * ph, x.shape[3] + 2 * pw)


def output_size(module: nn.Conv2d, H: int, W: int) -> tuple[int, int]:
    """Output positions of a convolution over a padded ``H × W`` input."""
    (sh, sw), (dh, dw), (kh, kw) = module.stride, module.dilation, module.kernel_size
    return (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1


LOW_DTYPES = (torch.bfloat16, torch.float16)  # what a lower-precision pass hands on (widened before products)


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 where it came from a lower-precision pass (:data:`LOW_DTYPES`), else as it is."""
    return t.float() if t.dtype in LOW_DTYPES else t
