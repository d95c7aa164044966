"""Grams ``X Yᵀ`` in float64 over up to ~10^6 columns, from float32 (or widened bfloat16) products
over fixed-size chunks: the one summation rule every Kronecker factor of the capture uses."""

from __future__ import annotations

import torch

from posterior_fusion.models.layers import widened

CHUNK_COLUMNS = 1 << 11  # float32 partial sums over at most this many columns, accumulated in float64


GRAM_GROUP_BYTES = 16 * 2**20  # bound of the float32 partial products held at once by :func:`float64_gram`


def float64_gram(X: torch.Tensor, Y: torch.Tensor | None = None) -> torch.Tensor:
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
        xs = widened(X[:, start:stop]).reshape(D, -1, CHUNK_COLUMNS).transpose(0, 1)  # (chunks, D, CHUNK_COLUMNS)
        ys = xs if Y is X else widened(Y[:, start:stop]).reshape(E, -1, CHUNK_COLUMNS).transpose(0, 1)
        out += torch.bmm(xs, ys.transpose(1, 2)).sum(0, dtype=torch.float64)
    if full < K:
        out += (widened(X[:, full:]) @ widened(Y[:, full:]).T).double()
    return out
