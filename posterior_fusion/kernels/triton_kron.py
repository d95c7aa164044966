"""Triton kernels for the batched Kronecker quadratic forms (CUDA; CPU via TRITON_INTERPRET=1).

One generic kernel computes a tile of ``Z = Aᵀ X B`` for each (point k, component n) pair,
looping over the two reduction dimensions, and applies one of three epilogues:

* ``MODE_Q``    — forward: ``q[k, n] += Σ_tile Z² ∘ S`` (``Z`` never reaches global memory);
* ``MODE_Y``    — backward stage 1: ``Y[k, n] = 2 g[k, n] Z ∘ S``;
* ``MODE_GRAD`` — backward stage 2: ``G[k] += UB Y UAᵀ`` (sum over components by atomics);
* ``MODE_DQ``   — direct form, forward: with ``A`` = the raw factor B_n and ``B`` = the raw A_n
  (symmetric), ``Z = B_n V A_n`` and ``q[k, n] += Σ_tile (s_n Z + λ_n V) ∘ V``;
* ``MODE_DGRAD`` — direct form, backward in one pass: ``G[k] += 2 g[k, n] (s_n Z + λ_n V)``.

``X`` is ``W[k] − mu[n]`` (forward, stage 1; the difference is formed on load) or ``Y[k, n]``
(stage 2). All transposes are expressed through strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MODE_Q, MODE_Y, MODE_GRAD, MODE_DQ, MODE_DGRAD = 0, 1, 2, 3, 4


@triton.jit
def _sandwich_kernel(
    A, sAn, sAk, sAi,            # A[n, k, i]   (reduction over k = rows of X)
    X, sXp, sXk, sXl,            # X[p, k, l]   p = k*N+n (or k when X_PER_POINT)
    MU, sMn, sMk, sMl,           # mu[n, k, l]  subtracted on load when HAS_MU
    B, sBn, sBl, sBj,            # B[n, l, j]   (reduction over l = cols of X)
    S, sSn, sSi, sSj,            # S[n, i, j]
    G, sGp,                      # MODE_Y, MODE_DGRAD: g[p]
    SC, sSCn, sSCc,              # direct form: scale s_n = SC[n, 0], shift λ_n = SC[n, 1]
    OUT, sOp, sOi, sOj,          # MODE_Q: q[p]; MODE_Y: Y[p, i, j]; MODE_GRAD: grad[k, i, j]
    N, DK, DL, DI, DJ,
    MODE: tl.constexpr, HAS_MU: tl.constexpr, X_PER_POINT: tl.constexpr, DTYPE: tl.constexpr,
    BI: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr, BL: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_i = tl.program_id(1)
    pid_j = tl.program_id(2)
    kk = pair // N
    n = pair % N
    offs_i = pid_i * BI + tl.arange(0, BI)
    offs_j = pid_j * BJ + tl.arange(0, BJ)
    x_base = X + (kk if X_PER_POINT else pair) * sXp
    z = tl.zeros((BI, BJ), dtype=DTYPE)
    for l0 in range(0, DL, BL):
        offs_l = l0 + tl.arange(0, BL)
        t = tl.zeros((BI, BL), dtype=DTYPE)
        for k0 in range(0, DK, BK):
            offs_k = k0 + tl.arange(0, BK)
            a = tl.load(A + n * sAn + offs_k[:, None] * sAk + offs_i[None, :] * sAi,
                        mask=(offs_k[:, None] < DK) & (offs_i[None, :] < DI), other=0.0)
            xmask = (offs_k[:, None] < DK) & (offs_l[None, :] < DL)
            x = tl.load(x_base + offs_k[:, None] * sXk + offs_l[None, :] * sXl, mask=xmask, other=0.0)
            if HAS_MU:
                x = x - tl.load(MU + n * sMn + offs_k[:, None] * sMk + offs_l[None, :] * sMl, mask=xmask, other=0.0)
            t += tl.dot(tl.trans(a), x, input_precision="ieee")
        b = tl.load(B + n * sBn + offs_l[:, None] * sBl + offs_j[None, :] * sBj,
                    mask=(offs_l[:, None] < DL) & (offs_j[None, :] < DJ), other=0.0)
        z += tl.dot(t, b, input_precision="ieee")
    tile_mask = (offs_i[:, None] < DI) & (offs_j[None, :] < DJ)
    if MODE >= 3:  # direct form: here DI = DK, DJ = DL, and V = X − MU at the tile's (i, j)
        v = tl.load(x_base + offs_i[:, None] * sXk + offs_j[None, :] * sXl, mask=tile_mask, other=0.0)
        v = v - tl.load(MU + n * sMn + offs_i[:, None] * sMk + offs_j[None, :] * sMl, mask=tile_mask, other=0.0)
        sc = tl.load(SC + n * sSCn)
        sh = tl.load(SC + n * sSCn + sSCc)
        m = sc * z + sh * v
        if MODE == 3:
            tl.atomic_add(OUT + pair * sOp, tl.sum(tl.sum(m * v, axis=1), axis=0))
        else:
            g = tl.load(G + pair * sGp)
            tl.atomic_add(OUT + kk * sOp + offs_i[:, None] * sOi + offs_j[None, :] * sOj, 2.0 * g * m, mask=tile_mask)
    elif MODE == 2:
        tl.atomic_add(OUT + kk * sOp + offs_i[:, None] * sOi + offs_j[None, :] * sOj, z, mask=tile_mask)
    else:
        s = tl.load(S + n * sSn + offs_i[:, None] * sSi + offs_j[None, :] * sSj, mask=tile_mask, other=0.0)
        if MODE == 0:
            tl.atomic_add(OUT + pair * sOp, tl.sum(tl.sum(z * z * s, axis=1), axis=0))
        else:
            g = tl.load(G + pair * sGp)
            tl.store(OUT + pair * sOp + offs_i[:, None] * sOi + offs_j[None, :] * sOj, 2.0 * g * z * s, mask=tile_mask)


def _block(n: int) -> int:
    return max(16, min(64, triton.next_power_of_2(n)))


def _launch(A, X, MU, B, S, G, out, K, N, DK, DL, DI, DJ, mode, has_mu, x_per_point, SC=None):
    BI, BJ, BK, BL = _block(DI), _block(DJ), _block(DK), _block(DL)
    grid = (K * N, triton.cdiv(DI, BI), triton.cdiv(DJ, BJ))
    mu = MU if MU is not None else X
    s = S if S is not None else A
    g = G if G is not None else out
    sc = SC if SC is not None else A
    _sandwich_kernel[grid](
        A, A.stride(0), A.stride(1), A.stride(2),
        X, X.stride(0), X.stride(1), X.stride(2),
        mu, mu.stride(0), mu.stride(1), mu.stride(2),
        B, B.stride(0), B.stride(1), B.stride(2),
        s, s.stride(0), s.stride(1), s.stride(2),
        g, g.stride(0),
        sc, sc.stride(0), sc.stride(1) if sc.dim() > 1 else 0,
        out, out.stride(0), out.stride(1) if out.dim() > 1 else 0, out.stride(2) if out.dim() > 2 else 0,
        N, DK, DL, DI, DJ,
        MODE=mode, HAS_MU=has_mu, X_PER_POINT=x_per_point, BI=BI, BJ=BJ, BK=BK, BL=BL,
        DTYPE=tl.float64 if X.dtype == torch.float64 else tl.float32,
    )


def quadratic_forms(W: torch.Tensor, mu: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor,
                    S: torch.Tensor) -> torch.Tensor:
    """Fused forward: ``q`` ``(K, N)`` (float32 or float64 as ``W``; shapes as in :mod:`.reference`)."""
    K, P, Q = W.shape
    N, _, R1 = UB.shape
    R2 = UA.shape[2]
    q = torch.zeros(K * N, device=W.device, dtype=W.dtype)
    # Z[i, j] = Σ_k Σ_l UB[k, i] X[k, l] UA[l, j]  with X = W[k] − mu[n]
    _launch(UB, W, mu, UA, S, None, q, K, N, P, Q, R1, R2, MODE_Q, True, True)
    return q.reshape(K, N)


def quadratic_forms_grad(W: torch.Tensor, mu: torch.Tensor, UB: torch.Tensor, UA: torch.Tensor,
                         S: torch.Tensor, grad_q: torch.Tensor) -> torch.Tensor:
    """Fused backward: gradient ``(K, P, Q)`` of ``Σ grad_q ∘ q`` w.r.t. ``W``."""
    K, P, Q = W.shape
    N, _, R1 = UB.shape
    R2 = UA.shape[2]
    g = grad_q.reshape(K * N).contiguous().to(W.dtype)
    Y = torch.empty(K * N, R1, R2, device=W.device, dtype=W.dtype)
    _launch(UB, W, mu, UA, S, g, Y, K, N, P, Q, R1, R2, MODE_Y, True, True)
    grad = torch.zeros(K, P, Q, device=W.device, dtype=W.dtype)
    # grad[k][i, j] += Σ_a Σ_b UB[i, a] Y[a, b] UA[j, b]  ->  A[n, a, i] = UB[n, i, a] (a transpose view)
    _launch(UB.transpose(1, 2), Y, None, UA.transpose(1, 2), None, None, grad, K, N, R1, R2, P, Q,
            MODE_GRAD, False, False)
    return grad


def direct_forms(W: torch.Tensor, mu: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: torch.Tensor,
                 shift: torch.Tensor) -> torch.Tensor:
    """Direct form, fused: ``q[k, n] = s_n ⟨V, B_n V A_n⟩ + λ_n ‖V‖²``, ``V = W[k] − mu[n]``
    (``B`` ``(N, P, P)``, ``A`` ``(N, Q, Q)`` symmetric; as :func:`..reference.direct_forms`)."""
    K, P, Q = W.shape
    N = mu.shape[0]
    sc = torch.stack([scale, shift], 1).to(W.dtype).contiguous()
    q = torch.zeros(K * N, device=W.device, dtype=W.dtype)
    # Z[i, j] = Σ_a Σ_b B[a, i] V[a, b] A[b, j] = (B V A)[i, j] for symmetric B
    _launch(B, W, mu, A, None, None, q, K, N, P, Q, P, Q, MODE_DQ, True, True, sc)
    return q.reshape(K, N)


def direct_forms_grad(W: torch.Tensor, mu: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: torch.Tensor,
                      shift: torch.Tensor, grad_q: torch.Tensor) -> torch.Tensor:
    """Direct form, fused backward in one pass: ``Σ_n 2 g[k, n] (s_n B_n V A_n + λ_n V)``."""
    K, P, Q = W.shape
    N = mu.shape[0]
    sc = torch.stack([scale, shift], 1).to(W.dtype).contiguous()
    g = grad_q.reshape(K * N).contiguous().to(W.dtype)
    grad = torch.zeros(K, P, Q, device=W.device, dtype=W.dtype)
    _launch(B, W, mu, A, None, g, grad, K, N, P, Q, P, Q, MODE_DGRAD, True, True, sc)
    return grad
