"""K-FAC's input factor ``A`` of a layer: the Gram of its inputs (expand: every sample and
position; reduce: each sample's positions averaged first). Three ways to form a convolution's
input Gram — the unfolded patches, the pixel Gram folded over kernel offsets, and shifted window
products — chosen per layer by their measured cost (:func:`input_gram_path`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posterior_fusion.local.capture import gram
from posterior_fusion.models.layers import conv_output_size, input_columns, kernel_windows, output_size

PIXEL_GRAM_MAX = 2048  # largest C·H·W whose pixel Gram (4·(C·H·W)² bytes) :func:`_conv_input_gram` forms


def _pixel_gram_pays(module: nn.Conv2d, x: torch.Tensor) -> bool:
    """Whether :func:`_conv_input_gram` is the faster way to a convolution's input factor: its
    ``(C·H·W)²`` multiply-adds per sample against the unfolded patches' ``(C·kh·kw)²·Ho·Wo`` (padded
    sizes) up to a factor 2 that buys back the patch copy, and a pixel Gram of at most
    :data:`PIXEL_GRAM_MAX` rows (a larger one is as slow as the patches: its GEMM writes more than it
    computes). The measurements behind the rule are in ``docs/benchmarks.md``, "Capture"."""
    (ph, pw), (kh, kw) = module.padding, module.kernel_size
    H, W = x.shape[2] + 2 * ph, x.shape[3] + 2 * pw
    Ho, Wo = output_size(module, H, W)
    return x.shape[1] * H * W <= PIXEL_GRAM_MAX and (H * W) ** 2 <= 2 * (kh * kw) ** 2 * Ho * Wo


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
    Ho, Wo = output_size(module, H, W)
    X = xp.reshape(M, C * H * W).T  # (C·H·W, M): one column per sample
    # one chunk: kept in x's dtype (the strided sums below are then 20 % cheaper); more: :func:`float64_gram`
    Q = X @ X.T if M <= gram.CHUNK_COLUMNS else gram.float64_gram(X)
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
    (kh, kw), (Ho, Wo), (M, C, H, W) = module.kernel_size, conv_output_size(module, x), x.shape
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
    Ho, Wo = conv_output_size(module, x)
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
            cache[dy, dx] = gram.float64_gram(flat[:, : L - s], flat[:, s:]) if s >= 0 else whole(-dy, -dx).T
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
            cache[key] = gram.float64_gram(src, dst) if len(ys) and len(xs) else Z.new_zeros(C, C, dtype=torch.float64)
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
    """How :func:`input_gram` forms a layer's input factor for the input ``x``: ``"pixel"``
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


def input_gram(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """K-FAC's input factor before scaling: ``(Σ u uᵀ (I, I) float64, positions per sample)``, by the
    path :func:`input_gram_path` chooses (the same sum in each; tested against the patches)."""
    path = input_gram_path(module, x)
    if path == "pixel":
        return _conv_input_gram(module, x)
    if path == "shifted":
        return _conv_input_gram_shifted(module, x)
    X = input_columns(module, x)
    return gram.float64_gram(X), X.shape[1] // x.shape[0]


def reduced_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """K-FAC-reduce's input per sample ``(M, I)``: the layer input averaged over the positions the
    weight is shared across — for a convolution the mean of its patches (rows in ``F.unfold``'s
    (channel, kh, kw) order), one strided window sum per kernel offset, no unfolding; for a linear
    layer the mean over the middle dimensions of ``(M, ..., I)``."""
    if isinstance(module, nn.Conv2d):
        (kh, kw), (M, C), (Ho, Wo) = module.kernel_size, x.shape[:2], conv_output_size(module, x)
        out = x.new_empty(M, C, kh, kw)
        for a, b, window in kernel_windows(module, x):
            out[:, :, a, b] = window.sum((2, 3))
        return out.reshape(M, C * kh * kw) / (Ho * Wo)
    return x.reshape(x.shape[0], -1, x.shape[-1]).mean(1)
