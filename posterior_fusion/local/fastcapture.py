"""Fast curvature capture for models whose parameters all sit in ``nn.Linear`` / ``nn.Conv2d``.

The same quantities as laplace-torch (``local/capture.py``, the test oracle), computed with one
forward pass per batch and one batched backward pass to the layer *outputs* (no weight
gradients). For a batch of M inputs with logits f ``(M, C)`` and probabilities p:

- exact GGN: the C columns of the cross-entropy Hessian square root, s_c = √p_c (e_c − p)
  ``(C, M, C)``, are back-propagated together (``is_grads_batched``); MC Fisher: one column
  p − e_ŷ per sample, ŷ ~ Categorical(p).
- K-FAC ("expand", laplace-torch's convention): for a layer with inputs u ``(M, S, I)`` (S
  spatial positions, unfolded patches for a convolution) and output gradients g ``(R, M, S, O)``
  (R = C columns, or 1 for MC): A = Σ uuᵀ / (N·S), B = Σ ggᵀ, weight block ``Kron(B, A)``,
  bias block ``Dense(B)`` (N: the silo's size).
- diagonal: per-sample gradients per column, squared and summed (Linear: Σ g² ⊗ u² without
  forming them).
- last layer full: Σ_n H_n ⊗ φ̃_n φ̃_nᵀ in closed form, H_n = diag(p_n) − p_n p_nᵀ, φ̃ = [φ; 1].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron, Precision
from posterior_fusion.models.pooling import fast_max_pooling
from posterior_fusion.progress import progress

SUPPORTED_LAYERS = (nn.Linear, nn.Conv2d)  # K-FAC blocks (weight: Kron, bias: Dense)
NORM_LAYERS = (nn.GroupNorm, nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)  # affine parameters: Diag blocks
KFAC_TYPES = ("expand", "reduce")
BLOCK_POLICY = {
    "kron": "Linear/Conv2d weight: K-FAC (Kron); its bias: Dense",
    "diag": "diagonal GGN from per-sample gradients",
    "prior": "no curvature captured (zero block: the prior alone)",
}
"""What each parameter's block holds (recorded per parameter in the artifact's ``curvature_blocks``)."""


def _conv_problem(module: nn.Module) -> str | None:
    if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"
                                          or isinstance(module.padding, str)):
        return "uses groups, a padding mode or string padding"
    return None


def _captured(module: nn.Module) -> bool:
    """Whether the fast capture back-propagates to this module's output (it owns curvature)."""
    return isinstance(module, SUPPORTED_LAYERS + NORM_LAYERS) and any(True for _ in module.parameters(recurse=False))


def unsupported_reason(model: nn.Module, example: torch.Tensor | None = None) -> str | None:
    """Why the fast capture cannot handle ``model`` (None when it can). With ``example`` (a
    small input batch) it also checks that every captured layer runs exactly once per forward pass.

    Layer policy (:func:`block_policy`): Linear/Conv2d K-FAC (or diagonal), GroupNorm / LayerNorm /
    BatchNorm (evaluation mode) affine parameters diagonal, any other parameter the prior alone."""
    for name, module in model.named_modules():
        problem = _conv_problem(module)
        if problem is not None:
            return f"convolution {name} {problem}"
        if isinstance(module, NORM_LAYERS[2:]) and module.training:
            return f"{type(module).__name__} {name} is in training mode (batch statistics couple the samples)"
    if not any(isinstance(m, SUPPORTED_LAYERS) for m in model.modules()):
        return "the model has no Linear or Conv2d layer"
    if example is not None:
        calls: dict[nn.Module, int] = {}
        layers = _layers(model)
        handles = [m.register_forward_hook(lambda m, i, o: calls.__setitem__(m, calls.get(m, 0) + 1))
                   for m in layers]
        try:
            with torch.no_grad():
                model(example)
        finally:
            for h in handles:
                h.remove()
        if any(calls.get(m, 0) != 1 for m in layers):
            return "a Linear/Conv2d or normalisation layer does not run exactly once per forward pass"
    return None


def _layers(model: nn.Module) -> list[nn.Module]:
    """The modules the capture back-propagates to, in ``model.modules()`` order."""
    return [m for m in model.modules() if _captured(m)]


def block_policy(model: nn.Module, structure: str) -> list[tuple[str, str]]:
    """``(parameter name, block)`` in ``model.parameters()`` order, block a key of :data:`BLOCK_POLICY`
    (``structure`` kron: Linear/Conv2d weights ``kron``, their biases ``dense``; diag: ``diag``)."""
    out = []
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if isinstance(module, SUPPORTED_LAYERS):
                kind = ("kron" if pname == "weight" else "dense") if structure == "kron" else "diag"
            elif isinstance(module, NORM_LAYERS):
                kind = "diag"
            else:
                kind = "prior"
            out.append((name, kind))
    return out


def _normalised(module: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """A normalisation layer's input ``u`` normalised, before its affine map (same shape as ``u``)."""
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(u, module.num_groups, eps=module.eps)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(u, module.normalized_shape, eps=module.eps)
    return F.batch_norm(u, module.running_mean, module.running_var, training=False, eps=module.eps)


def _norm_per_sample(module: nn.Module, u: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample gradients ``(M, k)`` of a normalisation layer's weight and bias (those that exist),
    from its input ``u`` and output gradient ``g``: weight Σ g ⊙ x̂, bias Σ g over the positions the
    parameter is shared across."""
    M = u.shape[0]
    xhat = _normalised(module, u)
    if isinstance(module, nn.LayerNorm):
        k = math.prod(module.normalized_shape)
        per = lambda t: t.reshape(M, -1, k).sum(1)  # noqa: E731
    else:  # channel axis 1
        per = lambda t: t.reshape(M, t.shape[1], -1).sum(2)  # noqa: E731
    out = []
    for pname, _ in module.named_parameters(recurse=False):
        out.append(per(g * xhat) if pname == "weight" else per(g))
    return out


CHUNK_COLUMNS = 1 << 11  # float32 partial sums over at most this many columns, accumulated in float64


def _kernel_windows(module: nn.Conv2d, x: torch.Tensor):
    """For each kernel offset ``(a, b)`` of a convolution, the strided view ``(M, C, Ho, Wo)`` of its
    zero-padded input ``x`` ``(M, C, H, W)`` that this offset meets at every output position."""
    (ph, pw), (sh, sw), (dh, dw) = module.padding, module.stride, module.dilation
    kh, kw = module.kernel_size
    xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    Ho, Wo = _conv_output_size(module, x)
    for a in range(kh):
        for b in range(kw):
            yield a, b, xp[:, :, a * dh : a * dh + (Ho - 1) * sh + 1 : sh, b * dw : b * dw + (Wo - 1) * sw + 1 : sw]


def _input_columns(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Layer input as columns ``(I, M·S)``: for a convolution the M·S patches of I values (rows ordered
    as ``F.unfold``'s (channel, kh, kw)), written by one strided copy per kernel offset (long runs of
    output positions rather than a windowed view copied patch by patch, whose inner runs are kw values;
    timings in ``docs/benchmarks.md``, "Capture"); for a linear layer a view of the inputs at every position."""
    if isinstance(module, nn.Conv2d):
        (kh, kw), (M, C), (Ho, Wo) = module.kernel_size, x.shape[:2], _conv_output_size(module, x)
        out = x.new_empty(C, kh, kw, M, Ho, Wo)
        for a, b, window in _kernel_windows(module, x):  # window (M, C, Ho, Wo)
            out[:, a, b] = window.transpose(0, 1)
        return out.view(C * kh * kw, M * Ho * Wo)
    return x.reshape(-1, x.shape[-1]).T


PIXEL_GRAM_MAX = 2048  # largest C·H·W whose pixel Gram (4·(C·H·W)² bytes) :func:`_conv_input_gram` forms


def _pixel_gram_pays(module: nn.Conv2d, x: torch.Tensor) -> bool:
    """Whether :func:`_conv_input_gram` is the faster way to a convolution's input factor: its
    ``(C·H·W)²`` multiply-adds per sample against the unfolded patches' ``(C·kh·kw)²·Ho·Wo`` (padded
    sizes) up to a factor 2 that buys back the patch copy, and a pixel Gram of at most
    :data:`PIXEL_GRAM_MAX` rows (a larger one is as slow as the patches: its GEMM writes more than it
    computes). The measurements behind the rule are in ``docs/benchmarks.md``, "Capture"."""
    (ph, pw), (kh, kw) = module.padding, module.kernel_size
    H, W = x.shape[2] + 2 * ph, x.shape[3] + 2 * pw
    Ho, Wo = _output_size(module, H, W)
    return x.shape[1] * H * W <= PIXEL_GRAM_MAX and (H * W) ** 2 <= 2 * (kh * kw) ** 2 * Ho * Wo


def _conv_output_size(module: nn.Conv2d, x: torch.Tensor) -> tuple[int, int]:
    """Output positions of a convolution over its input ``x`` ``(M, C, H, W)`` (padding included)."""
    (ph, pw) = module.padding
    return _output_size(module, x.shape[2] + 2 * ph, x.shape[3] + 2 * pw)


def _output_size(module: nn.Conv2d, H: int, W: int) -> tuple[int, int]:
    """Output positions of a convolution over a padded ``H × W`` input."""
    (sh, sw), (dh, dw), (kh, kw) = module.stride, module.dilation, module.kernel_size
    return (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1


def _conv_input_gram(module: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(Σ u uᵀ (I, I) float64, Ho·Wo)``: the sum over samples and output positions for a convolution's
    input ``x`` ``(M, C, H, W)``, ``u`` its patches in ``F.unfold``'s row order (channel, kh, kw), without
    unfolding: one pixel Gram ``Q = Σ_n x_n x_nᵀ`` ``(C·H·W, C·H·W)`` (x's dtype over at most
    :data:`CHUNK_COLUMNS` samples, float64 across such chunks), then each entry ``(c, a, b), (c', a', b')`` is
    the sum of ``Q`` over the positions both kernel offsets see,
    ``Σ_{i, j} Q[(c, i·s + a·d, j·s + b·d), (c', i·s + a'·d, j·s + b'·d)]`` — a strided view of ``Q`` summed
    over ``j`` (``Wo`` terms), then over ``i`` (float64)."""
    (ph, pw), (sh, sw), (dh, dw), (kh, kw) = module.padding, module.stride, module.dilation, module.kernel_size
    xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    M, C, H, W = xp.shape
    Ho, Wo = _output_size(module, H, W)
    X = xp.reshape(M, C * H * W).T  # (C·H·W, M): one column per sample
    # one chunk: kept in x's dtype (the strided sums below are then 20 % cheaper); more: :func:`_gram`
    Q = X @ X.T if M <= CHUNK_COLUMNS else _gram(X)
    q0, q1, q2 = Q.stride(0) * H * W, Q.stride(0) * W, Q.stride(0)  # (c, y, x) of the row
    q3, q4, q5 = H * W, W, 1  # (c', y', x') of the column
    rows = Q.as_strided((C, H, kw, C, H, kw, Wo), (q0, q1, dw * q2, q3, q4, dw * q5, sw * (q2 + q5))).sum(-1)
    r = rows.stride()  # (C, H, kw, C, H, kw)
    both = rows.as_strided((C, kh, kw, C, kh, kw, Ho), (r[0], dh * r[1], r[2], r[3], dh * r[4], r[5], sh * (r[1] + r[4])))
    return both.sum(-1, dtype=torch.float64).reshape(C * kh * kw, C * kh * kw), Ho * Wo


PRODUCT_OVERHEAD = 250_000  # a small product's fixed cost in multiply-adds (~25 µs; measured, docs/benchmarks.md)


def _shift_gram_pays(module: nn.Conv2d, x: torch.Tensor) -> bool:
    """Whether :func:`_conv_input_gram_shifted` is cheaper than the unfolded patches' ``M·(C·kh·kw)²·Ho·Wo``
    multiply-adds: stride 1, a kernel of more than one tap, and its own count — one product per
    displacement over the padded image, at most a row strip, a column strip and their corners per
    pair of kernel offsets, each product charged :data:`PRODUCT_OVERHEAD` (many channels, 3×3 kernels
    and "same" padding pay; one channel, or 5×5 kernels without padding, do not)."""
    if module.stride != (1, 1) or module.kernel_size == (1, 1):
        return False
    (kh, kw), (Ho, Wo), (M, C, H, W) = module.kernel_size, _conv_output_size(module, x), x.shape
    (qh, qw), (ph, pw), (dh, dw) = _shift_padding(module), module.padding, module.dilation
    Hz, Wz = H + 2 * qh, W + 2 * qw
    out_rows = max(sum(not qh - ph + a * dh <= i < qh - ph + a * dh + Ho for i in range(qh, qh + H)) for a in range(kh))
    out_cols = max(sum(not qw - pw + b * dw <= j < qw - pw + b * dw + Wo for j in range(qw, qw + W)) for b in range(kw))
    shifts = (2 * kh - 1) * (2 * kw - 1) // 2 + 1
    pairs = (kh * kw) ** 2
    products = shifts + pairs * (out_rows + out_cols + out_rows * out_cols)
    work = M * C * C * (shifts * Hz * Wz + pairs * (out_rows * W + out_cols * H)) + products * PRODUCT_OVERHEAD
    return work < M * (C * kh * kw) ** 2 * Ho * Wo


def _shift_padding(module: nn.Conv2d) -> tuple[int, int]:
    """Zero padding per side of :func:`_conv_input_gram_shifted`: the convolution's own, raised so that
    two samples' (or rows') real pixels are at least the kernel's reach apart in the flattened image."""
    return tuple(max(p, -(-d * (k - 1) // 2))
                 for p, d, k in zip(module.padding, module.dilation, module.kernel_size))


def _conv_input_gram_shifted(module: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(Σ u uᵀ (I, I) float64, Ho·Wo)`` for a stride-1 convolution's input ``x`` ``(M, C, H, W)``, ``u`` its
    patches in ``F.unfold``'s row order (channel, kh, kw), without unfolding. The entry of kernel offsets
    ``(a, b), (a', b')`` sums ``x_c[y, x] · x_c'[y + Δy, x + Δx]`` (``Δ = ((a'−a)·dh, (b'−b)·dw)``) over the
    positions ``(y, x)`` offset ``(a, b)`` meets — the window ``Wab``. Its sum over the whole image, ``P(Δ)``, is
    one ``(C, C)`` product of the flattened, zero-padded input with itself shifted by ``Δy·Wz + Δx`` (the
    padding of :func:`_shift_padding` puts every wrapped or cross-sample pair on a zero), one per
    displacement (``P(−Δ) = P(Δ)ᵀ``): ``(2kh−1)(2kw−1)/2`` products where the patches take ``(kh·kw)²``.
    The window's sum is ``P(Δ)`` less the real rows and columns outside ``Wab`` (inclusion–exclusion over
    at most ``dh(kh−1)`` rows and ``dw(kw−1)`` columns, each a small product, cached by position and Δ)."""
    (dh, dw), (kh, kw) = module.dilation, module.kernel_size
    (ph, pw), (qh, qw) = module.padding, _shift_padding(module)
    M, C, H, W = x.shape
    Ho, Wo = _conv_output_size(module, x)
    Z = F.pad(x, (qw, qw, qh, qh)).transpose(0, 1).contiguous()  # (C, M, Hz, Wz)
    Hz, Wz = Z.shape[2:]
    flat = Z.view(C, -1)
    L = flat.shape[1]
    rows, cols = range(qh, qh + H), range(qw, qw + W)  # the real pixels
    cache: dict[tuple, torch.Tensor] = {}

    def whole(dy: int, dx: int) -> torch.Tensor:
        """``P(Δ)`` ``(C, C)``: every pair of real pixels at displacement Δ."""
        if (dy, dx) not in cache:
            s = dy * Wz + dx
            cache[dy, dx] = _gram(flat[:, : L - s], flat[:, s:]) if s >= 0 else whole(-dy, -dx).T
        return cache[dy, dx]

    def part(ys: range, xs: range, dy: int, dx: int) -> torch.Tensor:
        """The pairs whose first pixel lies in rows ``ys`` × columns ``xs`` (one of them a single row
        or column), the second inside the padded image."""
        key = (ys.start, ys.stop, xs.start, xs.stop, dy, dx)
        if key not in cache:
            ys = range(max(ys.start, -dy), min(ys.stop, Hz - dy))
            xs = range(max(xs.start, -dx), min(xs.stop, Wz - dx))
            src = Z[:, :, ys.start : ys.stop, xs.start : xs.stop].reshape(C, -1)
            dst = Z[:, :, ys.start + dy : ys.stop + dy, xs.start + dx : xs.stop + dx].reshape(C, -1)
            cache[key] = _gram(src, dst) if len(ys) and len(xs) else Z.new_zeros(C, C, dtype=torch.float64)
        return cache[key]

    def outside(real: range, start: int, size: int) -> list[range]:
        """The real rows (columns) outside the window ``[start, start + size)``, one range each."""
        return [range(i, i + 1) for i in real if not start <= i < start + size]

    out = torch.empty(C, kh, kw, C, kh, kw, dtype=torch.float64, device=x.device)
    for a in range(kh):
        rows_out = outside(rows, qh - ph + a * dh, Ho)
        for b in range(kw):
            cols_out = outside(cols, qw - pw + b * dw, Wo)
            for a2 in range(kh):
                for b2 in range(kw):
                    dy, dx = (a2 - a) * dh, (b2 - b) * dw
                    block = whole(dy, dx).clone()
                    for ys in rows_out:
                        block -= part(ys, cols, dy, dx)
                    for xs in cols_out:
                        block -= part(rows, xs, dy, dx)
                        for ys in rows_out:
                            block += part(ys, xs, dy, dx)
                    out[:, a, b, :, a2, b2] = block
    return out.reshape(C * kh * kw, C * kh * kw), Ho * Wo


def input_gram_path(module: nn.Module, x: torch.Tensor) -> str:
    """How :func:`_input_gram` forms a layer's input factor for the input ``x``: ``"pixel"``
    (:func:`_conv_input_gram`), ``"shifted"`` (:func:`_conv_input_gram_shifted`) or ``"patches"`` (the
    unfolded patches' Gram, a few batched GEMMs). The first two trade the patches' multiply-adds for
    many small products, which pays on a CPU only: on a GPU each product is a kernel launch, and the
    shifted path's ≈ 32,000 operations per pass at ResNet-20 width 64 (7 µs each, measured on an H200)
    cost far more than the patches' GEMMs (docs/benchmarks.md, "On a GPU: models at real size")."""
    if not isinstance(module, nn.Conv2d) or x.device.type != "cpu":
        return "patches"
    if _pixel_gram_pays(module, x):
        return "pixel"
    return "shifted" if _shift_gram_pays(module, x) else "patches"


def _input_gram(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """K-FAC's input factor before scaling: ``(Σ u uᵀ (I, I) float64, positions per sample)``, by the
    path :func:`input_gram_path` chooses (the same sum in each; tested against the patches)."""
    path = input_gram_path(module, x)
    if path == "pixel":
        return _conv_input_gram(module, x)
    if path == "shifted":
        return _conv_input_gram_shifted(module, x)
    X = _input_columns(module, x)
    return _gram(X), X.shape[1] // x.shape[0]


def _reduced_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """K-FAC-reduce's input per sample ``(M, I)``: the layer input averaged over the positions the
    weight is shared across — for a convolution the mean of its patches (rows in ``F.unfold``'s
    (channel, kh, kw) order), one strided window sum per kernel offset, no unfolding; for a linear
    layer the mean over the middle dimensions of ``(M, ..., I)``."""
    if isinstance(module, nn.Conv2d):
        (kh, kw), (M, C), (Ho, Wo) = module.kernel_size, x.shape[:2], _conv_output_size(module, x)
        out = x.new_empty(M, C, kh, kw)
        for a, b, window in _kernel_windows(module, x):
            out[:, :, a, b] = window.sum((2, 3))
        return out.reshape(M, C * kh * kw) / (Ho * Wo)
    return x.reshape(x.shape[0], -1, x.shape[-1]).mean(1)


def _reduced_grad(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """K-FAC-reduce's output gradient per sample ``(M, O)``: summed over the shared positions."""
    if isinstance(module, nn.Conv2d):
        return g.sum((2, 3))
    return g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)


def _grad_columns(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """Output gradient ``(M, O, ...)`` (conv) or ``(M, ..., O)`` (linear) as columns ``(O, M·S)``."""
    if isinstance(module, nn.Conv2d):
        return g.transpose(0, 1).reshape(g.shape[1], -1)
    return g.reshape(-1, g.shape[-1]).T


def _per_sample(module: nn.Module, patches: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample weight and bias gradients ``(M, O, I)``, ``(M, O)`` of one back-propagated column,
    from the input ``patches`` ``(M, I, S)`` and the output gradient."""
    M = patches.shape[0]
    g3 = g.reshape(M, g.shape[1], -1) if isinstance(module, nn.Conv2d) else g.reshape(M, -1, g.shape[-1]).transpose(1, 2)
    return g3 @ patches.transpose(1, 2), g3.sum(2)


LOW_DTYPES = (torch.bfloat16, torch.float16)  # what a lower-precision pass hands on (widened before products)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 where it came from a lower-precision pass (:data:`LOW_DTYPES`), else as it is."""
    return t.float() if t.dtype in LOW_DTYPES else t


WIDEN_SAMPLES = 16  # samples widened at once by :func:`_output_gram` (the widened copy stays in cache)


def _output_gram(module: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """``Σ`` over samples and positions of ``g gᵀ`` ``(O, O)`` in float64, for a layer's output gradient
    (conv ``(M, O, H, W)``, linear ``(M, ..., O)``). A convolution with at most :data:`CHUNK_COLUMNS`
    positions and no more channels than positions takes one batched product per sample straight
    from ``g``'s memory (float32 over one sample's positions, float64 over samples): no transposed
    copy of ``g`` (faster than the column chunks there: ``docs/benchmarks.md``, "Capture")."""
    if isinstance(module, nn.Conv2d):
        g3 = g.reshape(g.shape[0], g.shape[1], -1)  # (M, O, S)
        if g3.shape[1] <= g3.shape[2] <= CHUNK_COLUMNS:
            if g3.dtype not in LOW_DTYPES:
                return torch.bmm(g3, g3.transpose(1, 2)).sum(0, dtype=torch.float64)
            out = 0
            for i in range(0, g3.shape[0], WIDEN_SAMPLES):
                c = _wide(g3[i: i + WIDEN_SAMPLES])
                out = out + torch.bmm(c, c.transpose(1, 2)).sum(0, dtype=torch.float64)
            return out
    return _gram(_grad_columns(module, g))


GRAM_GROUP_BYTES = 16 * 2**20  # bound of the float32 partial products held at once by :func:`_gram`


def _gram(X: torch.Tensor, Y: torch.Tensor | None = None) -> torch.Tensor:
    """``X Yᵀ`` ``(D, E)`` in float64 (``Y`` None: ``X Xᵀ``) for ``X`` ``(D, K)``, ``Y`` ``(E, K)``, K up to
    ~10^6 (either may be a strided view whose last dimension is contiguous): float32 products over
    chunks of :data:`CHUNK_COLUMNS` columns (error ~√chunk·ε; laplace-torch's float32 sums over whole
    batches are up to 1.4e-5 off), taken as batched GEMMs of several chunks at once and summed in float64."""
    Y = X if Y is None else Y
    (D, K), E = X.shape, Y.shape[0]
    out = torch.zeros(D, E, dtype=torch.float64, device=X.device)
    full = K - K % CHUNK_COLUMNS
    group = max(1, GRAM_GROUP_BYTES // (4 * D * E)) * CHUNK_COLUMNS  # columns per batched GEMM
    for start in range(0, full, group):
        stop = min(start + group, full)
        xs = _wide(X[:, start:stop]).reshape(D, -1, CHUNK_COLUMNS).transpose(0, 1)  # (chunks, D, CHUNK_COLUMNS)
        ys = xs if Y is X else _wide(Y[:, start:stop]).reshape(E, -1, CHUNK_COLUMNS).transpose(0, 1)
        out += torch.bmm(xs, ys.transpose(1, 2)).sum(0, dtype=torch.float64)
    if full < K:
        out += (_wide(X[:, full:]) @ _wide(Y[:, full:]).T).double()
    return out


def _columns(logits: torch.Tensor, ggn: str, generator: torch.Generator | None) -> torch.Tensor:
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


JACOBIAN = "jacobian"  # :func:`_columns` of the logit Jacobian (the linearised predictive), not a GGN


def jacobian_problem(model: nn.Module, example: torch.Tensor) -> str | None:
    """Why :func:`logit_jacobians` cannot serve ``model`` (None when it can): every parameter must sit
    in a layer the capture back-propagates to (Linear/Conv2d, normalisation), each run once per pass."""
    reason = unsupported_reason(model, example)
    if reason is not None:
        return reason
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)) and not _captured(module):
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
    weight and bias: its per-sample gradients).

    One forward pass and C backward passes to the layer *outputs* (no weight gradients); a layer's
    inputs and output gradients are let go once its Jacobians are yielded. Requires
    :func:`jacobian_problem` to be None."""
    layers = _layers(model)
    kept: dict = {}

    def on_column(r, inputs, grads):
        kept.setdefault("inputs", inputs)
        kept.setdefault("grads", []).append(grads)

    with _no_param_grads(model):
        logits = _batch_pass(model, layers, xb, JACOBIAN, None, on_column)
    yield -1, logits
    inputs, cols = list(kept.pop("inputs")), [list(g) for g in kept.pop("grads")]  # cols[c][i]: layer i, class c
    starts, first = {}, 0
    for module in model.modules():
        starts[module] = first
        first += len(list(module.parameters(recurse=False)))
    M, C = xb.shape[0], len(cols)
    for i, layer in enumerate(layers):
        u = inputs[i]
        if isinstance(layer, NORM_LAYERS):
            per_class = [_norm_per_sample(layer, u, g[i]) for g in cols]  # C x [(M, k) per parameter]
            parts = [torch.stack([pc[j] for pc in per_class], 1) for j in range(len(per_class[0]))]
        else:
            if isinstance(layer, nn.Conv2d):
                X = _input_columns(layer, u)
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


def _batch_pass(model: nn.Module, layers: list[nn.Module], xb: torch.Tensor, ggn: str,
                generator: torch.Generator | None, on_column, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One forward pass, then one backward pass per column to the layer *outputs* only (the
    graph is kept between them); calls ``on_column(r, inputs, grads)`` with the column index, the
    layers' inputs and their output gradients for that column; returns the logits (detached). (A single vmapped backward over the C columns,
    ``is_grads_batched``, is slower on the CPU: ``docs/benchmarks.md``, "Capture".)

    ``compute_dtype`` (e.g. ``torch.bfloat16``): the passes run under autocast in that type; the
    columns come from float32 probabilities, the inputs are handed on in the model's own type and the
    output gradients in the pass's (consumers widen them with :func:`_wide`, the Grams chunk by chunk),
    so every factor is the exact float32/float64 sum of products of these rounded vectors (a Gram of
    rounded vectors stays positive semi-definite)."""
    ins: dict[nn.Module, torch.Tensor] = {}
    outs: dict[nn.Module, torch.Tensor] = {}

    def hook(m, inp, out):
        ins[m] = inp[0].detach()
        if not out.requires_grad:  # the first layer: its output starts the graph (no input gradients)
            out = out.detach().requires_grad_(True)
        outs[m] = out
        return out

    handles = [m.register_forward_hook(hook) for m in layers]
    low = compute_dtype is not None
    try:
        with torch.enable_grad(), torch.autocast(xb.device.type, dtype=compute_dtype or torch.bfloat16, enabled=low):
            logits = model(xb)
    finally:
        for h in handles:
            h.remove()
    if not low:
        cols = _columns(logits, ggn, generator)
        inputs = [ins[m] for m in layers]
    else:  # the loss Hessian's columns from float32 probabilities, back-propagated in the pass's type
        cols = _columns(logits.float(), ggn, generator).to(logits.dtype)
        inputs = [ins[m].to(xb.dtype) for m in layers]
    targets = [outs[m] for m in layers]
    for r in range(len(cols)):
        grads = torch.autograd.grad(logits, targets, cols[r], retain_graph=r < len(cols) - 1)
        on_column(r, inputs, grads)
    return logits.detach().to(xb.dtype)


def _no_param_grads(model: nn.Module):
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


PASS_BYTES = 384 * 2**20  # on the CPU: bound of the activations one capture pass keeps for its backward passes
GPU_PASS_SHARE = 0.25  # on a GPU: the share of its memory free at capture time that one pass may keep


def pass_bytes(device: torch.device) -> int:
    """Bytes of activations one capture pass may keep: :data:`PASS_BYTES` of host memory on the CPU
    (what bounds ``fit-local``'s resident peak); on a GPU :data:`GPU_PASS_SHARE` of the memory free on it
    now. A GPU held to the CPU's bound runs many small passes and waits on their kernel launches: ResNet-20
    at width 64 was captured in 52 passes of 20 samples on an H200, K-FAC-reduce with the MC GGN costing
    11 epochs (docs/benchmarks.md, "On a GPU: models at real size")."""
    if device.type == "cuda":
        return int(GPU_PASS_SHARE * torch.cuda.mem_get_info(device)[0])
    return PASS_BYTES


def _pass_size(model: nn.Module, x: torch.Tensor, batch_size: int) -> int:
    """Samples per capture pass: ``batch_size``, or fewer where the activations the pass keeps for
    its C − 1 backward passes (estimated as twice every module output of one sample, the graph's
    saved tensors and the output gradients) would exceed :func:`pass_bytes` on ``x``'s device. The
    captured sums do not depend on how the samples are grouped (MC labels are drawn row by row from
    the same generator), so this bounds the peak memory of large models without changing the result."""
    per_sample = max(1, 2 * sum(output_bytes(model, x[:1])))
    return max(1, min(batch_size, pass_bytes(x.device) // per_sample))


def output_bytes(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Bytes of every leaf module's output for the input ``x`` (one forward pass without gradients)."""
    sizes: list[int] = []
    handles = [m.register_forward_hook(lambda m, i, o: sizes.append(o.numel() * o.element_size()
                                                                   if isinstance(o, torch.Tensor) else 0))
               for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return sizes


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
    ``Dense(B)`` per bias, a ``Diag`` per normalisation-layer parameter and a zero ``Diag`` (the prior
    alone) for any other parameter (:func:`block_policy`).

    ``kfac="expand"``: A = Σ uuᵀ / (N·S) and B = Σ ggᵀ over samples *and* shared positions;
    ``"reduce"`` (Eschenhagen et al. 2023): A = Σ_n ū_n ū_nᵀ / N with ū the patches' mean over the S
    positions and B = Σ_n ĝ_n ĝ_nᵀ with ĝ the output gradient summed over them (curvlinops'
    conventions; both equal for layers without weight sharing). ``compute_dtype``: the passes' type
    (:func:`_batch_pass`; None: the model's)."""
    if kfac not in KFAC_TYPES:
        raise ValueError(f"unknown K-FAC type {kfac!r}; use one of {', '.join(KFAC_TYPES)}")
    layers = _layers(model)
    n = x.shape[0]
    A: list = [0.0] * len(layers)
    B: list = [0.0] * len(layers)
    D: dict[int, list] = {}  # normalisation layers: squared per-sample gradients, one sum per parameter

    def on_column(r, inputs, grads):
        for i, (layer, u, g) in enumerate(zip(layers, inputs, grads)):
            if isinstance(layer, NORM_LAYERS):
                parts = [(t.double() ** 2).sum(0) for t in _norm_per_sample(layer, u, _wide(g))]
                D[i] = parts if i not in D else [d + p for d, p in zip(D[i], parts)]
            elif kfac == "reduce":
                G = _reduced_grad(layer, _wide(g))
                B[i] = B[i] + _gram(G.T)
                if r == 0:
                    A[i] = A[i] + _gram(_reduced_input(layer, u).T) / n
            else:
                B[i] = B[i] + _output_gram(layer, g)
                if r == 0:  # A depends on the inputs only: once per batch (mean over positions)
                    gram, positions = _input_gram(layer, u)
                    A[i] = A[i] + gram / (n * positions)

    with _no_param_grads(model):
        for xb, _ in _loader(x, y, _pass_size(model, x, batch_size), "curvature"):
            _batch_pass(model, layers, xb, ggn, generator, on_column, compute_dtype)
    own = {layer: i for i, layer in enumerate(layers)}
    blocks: list[Precision] = []
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        i = own.get(module)
        if i is not None and isinstance(module, SUPPORTED_LAYERS):
            a, b = A[i].to("cpu", module.weight.dtype), B[i].to("cpu", module.weight.dtype)  # results on the CPU
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
    layers = _layers(model)
    sums: dict[int, list] = {}  # per captured layer: one float64 sum of squared per-sample gradients per parameter

    squared: dict[int, torch.Tensor] = {}  # per batch: u² (linear) or the input patches (weight sharing)

    def add(i: int, parts: list[torch.Tensor]) -> None:
        sums[i] = parts if i not in sums else [s + p for s, p in zip(sums[i], parts)]

    def on_column(r, inputs, grads):
        for i, (layer, u, g) in enumerate(zip(layers, inputs, map(_wide, grads))):
            if isinstance(layer, NORM_LAYERS):
                add(i, [(t.double() ** 2).sum(0) for t in _norm_per_sample(layer, u, g)])
            elif isinstance(layer, nn.Linear) and u.ndim == 2:  # per-sample gradient g uᵀ: square = g² (u²)ᵀ
                if r == 0:
                    squared[i] = u.double() ** 2
                g2 = g.double() ** 2
                add(i, [g2.T @ squared[i], g2.sum(0)])
            else:  # weight sharing: per-sample gradients summed over positions, then squared
                if r == 0:
                    X = _input_columns(layer, u)  # (I, M·S) -> per-sample patches (M, I, S), a view
                    squared[i] = X.view(X.shape[0], u.shape[0], -1).transpose(0, 1)
                pw, pb = _per_sample(layer, squared[i], g)
                add(i, [(pw * pw).sum(0, dtype=torch.float64), (pb * pb).sum(0, dtype=torch.float64)])

    with _no_param_grads(model):
        for xb, _ in _loader(x, y, _pass_size(model, x, batch_size), "curvature"):
            _batch_pass(model, layers, xb, ggn, generator, on_column, compute_dtype)
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


def fast_diag(model, x, y, batch_size=256, ggn="exact", generator=None, compute_dtype=None) -> BlockDiag:
    return BlockDiag([Diag(fast_diag_vector(model, x, y, batch_size, ggn, generator, compute_dtype))])


def last_layer_ggn(model: nn.Module, x: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Exact GGN of the last ``nn.Linear`` (weight row-major, then bias): Σ_n H_n ⊗ φ̃_n φ̃_nᵀ
    ``(O·I + O, O·I + O)``, with φ the layer's input and H_n the CE Hessian at the logits."""
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
            for xb, _ in _loader(x, x.new_zeros(len(x)), batch_size, "curvature (last layer)"):
                feats.clear()
                p = model(xb).softmax(-1)
                phi = feats[0].reshape(len(xb), -1)
                if has_b:
                    phi = torch.cat([phi, phi.new_ones(len(phi), 1)], 1)
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
    g = fast_diag_vector(model, x, y, batch_size, ggn, generator, compute_dtype)
    H = last_layer_ggn(model, x, batch_size)
    p = H.shape[0]
    return BlockDiag([Diag(g[:-p]), Dense(0.5 * (H + H.T))])


FAST_CAPTURE = {"kron": fast_kron, "diag": fast_diag, "diag+full": fast_diag_full}
