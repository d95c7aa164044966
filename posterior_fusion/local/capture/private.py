"""The private curvature releases (:mod:`posterior_fusion.local.privacy`): per-sample contributions to the
diag, diag+full and kron curvature clipped, summed and released through the Gaussian mechanism."""

from __future__ import annotations

import math

import torch
from torch import nn

from posterior_fusion.curvature import BlockDiag, Dense, Diag
from posterior_fusion.local.capture.fast import kron_blocks
from posterior_fusion.local.capture.inputs import reduced_input
from posterior_fusion.local.capture.outputs import reduced_grad
from posterior_fusion.local.capture.policy import expanded_under_reduce
from posterior_fusion.local.fit_config import DPConfig
from posterior_fusion.models.jacobians import batch_pass, no_param_grads
from posterior_fusion.models.layers import (
    DIAG_LAYERS,
    SUPPORTED_LAYERS,
    captured_layers,
    embedding_per_sample,
    input_columns,
    norm_per_sample,
)


def per_sample_ggn_diagonal(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(M, d)``: each sample's contribution to the exact GGN diagonal, ``Σ_r (J_nᵀ s_nr)²`` with ``s_nr`` the
    C − 1 columns of a square root of the cross-entropy Hessian at its logits (torch.func, float32)."""
    from torch.func import functional_call, grad, vmap

    from posterior_fusion.models.jacobians import backprop_columns

    params = {k: v.detach() for k, v in model.named_parameters()}
    with torch.no_grad():
        S = backprop_columns(model(x), "exact", None)  # (R, M, C)

    def one(p, xi, si):
        return (functional_call(model, p, (xi[None],))[0] * si).sum()

    total = None
    for r in range(S.shape[0]):
        g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, S[r])
        flat = torch.cat([g[k].reshape(len(x), -1) for k in params], 1).square()
        total = flat if total is None else total + flat
    return total


def private_diagonal(model: nn.Module, x: torch.Tensor, cfg: DPConfig, release_noise: float,
                     generator: torch.Generator, batch_size: int = 64) -> torch.Tensor:
    """The released GGN diagonal ``(d,)``: per-sample contributions clipped to ``dp_curvature_clip`` (L2), summed,
    Gaussian noise ``release_noise · curvature_clip`` per coordinate, floored at 0."""
    total = None
    model.eval()
    for i in range(0, len(x), batch_size):
        c = per_sample_ggn_diagonal(model, x[i: i + batch_size]).double()
        scale = (cfg.dp_curvature_clip / c.norm(dim=1).clamp_min(1e-300)).clamp(max=1.0)
        part = (c * scale[:, None]).sum(0)
        total = part if total is None else total + part
    total = total.cpu()  # the noise is drawn on the CPU
    noise = release_noise * cfg.dp_curvature_clip * torch.randn(total.shape, generator=generator, dtype=torch.float64)
    return (total + noise).clamp_min(0).float()


def clipped_diag_full_sums(model: nn.Module, x: torch.Tensor, curvature_clip: float,
                           batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The diag+full capture's sums with each sample's contribution clipped, before any noise: the GGN diagonal of
    every parameter but the last ``nn.Linear``'s, ``Σ_n t_n c_n`` ``(d − p,)``, and that layer's full block
    ``Σ_n t_n H_n ⊗ φ̃_n φ̃_nᵀ`` ``(p, p)`` (weights row-major, then the bias, as :func:`last_layer_ggn`), float64.
    ``H_n = diag(π_n) − π_n π_nᵀ`` at the sample's probabilities, ``φ̃_n`` the layer's input with a 1 for the bias,
    and ``t_n = min(1, curvature_clip / √(‖c_n‖² + ‖H_n‖_F² ‖φ̃_n‖⁴))`` (``‖H_n ⊗ φ̃φ̃ᵀ‖_F = ‖H_n‖_F ‖φ̃_n‖²``): the
    diagonal and the block's upper triangle together move by at most ``curvature_clip`` (L2) when one sample is
    added or removed."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    n_out, n_in = last.weight.shape
    has_b = last.bias is not None
    k = n_in + has_b
    size = n_out * k
    diag = torch.zeros(0, dtype=torch.float64)
    block = torch.zeros(n_out, k, n_out, k, dtype=torch.float64)
    feats: list[torch.Tensor] = []
    model.eval()
    handle = last.register_forward_hook(lambda m, i, o: feats.append(i[0].detach()))
    try:
        for i in range(0, len(x), batch_size):
            xb = x[i: i + batch_size]
            c = per_sample_ggn_diagonal(model, xb).double()[:, :-size]  # the diagonal part: all but the last layer
            feats.clear()
            with torch.no_grad():
                probs = model(xb).double().softmax(-1).cpu()
            phi = feats[0].reshape(len(xb), -1).double().cpu()
            if has_b:
                phi = torch.cat([phi, phi.new_ones(len(phi), 1)], 1)
            H = cross_entropy_hessian(probs)                                        # (b, O, O), no cancellation
            block_sq = torch.linalg.matrix_norm(H).square() * phi.square().sum(1).square()  # ‖H_n ⊗ φ̃_n φ̃_nᵀ‖_F²
            t = (curvature_clip / (c.square().sum(1).cpu() + block_sq).sqrt().clamp_min(1e-300)).clamp(max=1.0)
            part = (t[:, None] * c.cpu()).sum(0)
            diag = part if i == 0 else diag + part
            # each sample's own clipped block t_n H_n ⊗ φ̃_n φ̃_nᵀ, summed in float64: one sample moves it by its own term
            block += torch.einsum("n,noq,ni,nj->oiqj", t, H, phi, phi)
    finally:
        handle.remove()
    block = block.reshape(size, size)
    if has_b:
        idx = torch.arange(size).reshape(n_out, k)
        order = torch.cat([idx[:, :n_in].reshape(-1), idx[:, n_in]])  # weights row-major, then the bias
        block = block[order][:, order]
    return diag, block


def cross_entropy_hessian(probs: torch.Tensor) -> torch.Tensor:
    """``diag(π) − π πᵀ`` ``(b, C, C)`` for probabilities ``(b, C)`` (float64), as the Gram ``V Vᵀ`` of the columns
    ``v_j = √π_j (e_j − π)``, whose entry ``1 − π_j`` is the sum of the other probabilities: no difference of two
    nearly equal numbers, so a saturated softmax gives its tiny true Hessian, not rounding noise."""
    others = probs.sum(-1, keepdim=True) - probs                               # 1 − π_j, as Σ_{i≠j} π_i
    root = probs.sqrt()
    V = -probs[:, :, None] * root[:, None, :]                                  # column j: −π_i √π_j ...
    V = V + torch.diag_embed(root * others + probs * root)                      # ... and √π_j (1 − π_j) at i = j
    return V @ V.transpose(1, 2)


def private_diag_full(model: nn.Module, x: torch.Tensor, cfg: DPConfig, release_noise: float,
                      generator: torch.Generator, batch_size: int = 64) -> BlockDiag:
    """The released diag+full curvature: :func:`clipped_diag_full_sums` with Gaussian noise
    ``release_noise · dp_curvature_clip`` on every diagonal entry and on every entry of the block's upper triangle
    (one release of sensitivity ``dp_curvature_clip``), the diagonal floored at 0 and the block made positive
    semi-definite (post-processing); blocks as :func:`fast_diag_full`'s."""
    diag, block = clipped_diag_full_sums(model, x, cfg.dp_curvature_clip, batch_size)
    std = release_noise * cfg.dp_curvature_clip
    diag = (diag + std * torch.randn(diag.shape, generator=generator, dtype=torch.float64)).clamp_min(0)
    block = _psd(block + _symmetric_noise(block.shape[0], std, generator))
    return BlockDiag([Diag(diag.float()), Dense(block.float())])


def _gram_norm(X: torch.Tensor) -> torch.Tensor:
    """``‖X_n X_nᵀ‖_F`` ``(M,)`` for ``X`` ``(M, a, b)`` through the smaller of the two Grams (float64)."""
    X = X.double()
    G = X @ X.transpose(1, 2) if X.shape[1] <= X.shape[2] else X.transpose(1, 2) @ X
    return G.flatten(1).norm(dim=1)


def _sample_columns(layer: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """A Linear/Conv2d layer's input per sample as columns ``(M, I, S)`` (S the positions its weight is shared over)."""
    if isinstance(layer, nn.Conv2d):
        X = input_columns(layer, u)
        return X.view(X.shape[0], u.shape[0], -1).transpose(0, 1)
    return u.reshape(u.shape[0], -1, u.shape[-1]).transpose(1, 2)


def _sample_grads(layer: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """A Linear/Conv2d layer's output gradient of one column per sample as ``(M, O, S)``."""
    if isinstance(layer, nn.Conv2d):
        return g.reshape(g.shape[0], g.shape[1], -1)
    return g.reshape(g.shape[0], -1, g.shape[-1]).transpose(1, 2)


def clipped_kron_sums(model: nn.Module, x: torch.Tensor, input_clip: float, curvature_clip: float,
                      kfac: str = "expand", batch_size: int = 64) -> tuple[list, list, list]:
    """The K-FAC capture's sums with each sample's contribution clipped, before any noise: per captured layer
    (``captured_layers`` order) ``A`` (Linear/Conv2d: ``Σ_n s_n A_n``, ``A_n = X_n X_nᵀ / S`` for expand, ``ū_n ū_nᵀ``
    for reduce; not divided by n), ``B`` (``Σ_n t_n B_n``, ``B_n = Σ_r G_nr G_nrᵀ`` over the C − 1 columns of the
    exact GGN) and ``D`` (a normalisation layer's or embedding's ``Σ_n t_n d_n``, ``d_n`` its squared per-sample
    gradients, one tensor per parameter), all float64. ``s_n = min(1, input_clip / ‖(A_n)_layers‖_F)`` and
    ``t_n = min(1, curvature_clip / ‖((B_n)_layers, (d_n)_layers)‖)``: adding or removing one sample moves the
    input sums by at most ``input_clip`` and the output sums by at most ``curvature_clip`` (Frobenius / L2 over all
    layers together)."""

    layers = captured_layers(model)
    expanded = expanded_under_reduce(model) if kfac == "reduce" else set()  # key projections: expand
    A: list = [0.0] * len(layers)
    B: list = [0.0] * len(layers)
    D: dict[int, list] = {}
    model.eval()
    with no_param_grads(model):
        for i in range(0, len(x), batch_size):
            xb = x[i: i + batch_size]
            cols: list = []
            kept: dict = {}

            def on_column(r, inputs, grads, cols=cols, kept=kept):
                kept.setdefault("inputs", inputs)
                cols.append(grads)

            batch_pass(model, layers, xb, "exact", None, on_column)
            inputs, M = kept["inputs"], xb.shape[0]
            a_sq = torch.zeros(M, dtype=torch.float64, device=xb.device)
            b_sq = torch.zeros(M, dtype=torch.float64, device=xb.device)
            parts: list = []
            for k, layer in enumerate(layers):
                u = inputs[k]
                if isinstance(layer, DIAG_LAYERS):
                    if isinstance(layer, nn.Embedding):
                        per = [sum(embedding_per_sample(layer, u, c[k]).double() ** 2 for c in cols)]
                    else:  # d_n per parameter: Σ_r of the squared per-sample gradients of column r
                        grads = [norm_per_sample(layer, u, c[k]) for c in cols]
                        per = [sum(gr[j].double() ** 2 for gr in grads) for j in range(len(grads[0]))]
                    b_sq += sum((t ** 2).sum(1) for t in per)
                    parts.append(("diag", per))
                    continue
                if kfac == "reduce" and layer not in expanded:
                    X = reduced_input(layer, u).double()[:, :, None]                       # (M, I, 1)
                    G = torch.stack([reduced_grad(layer, c[k]).double() for c in cols], 2)  # (M, O, R)
                    scale_a = 1.0
                else:
                    X = _sample_columns(layer, u).double()                                 # (M, I, S)
                    G = torch.cat([_sample_grads(layer, c[k]).double() for c in cols], 2)  # (M, O, R·S)
                    scale_a = 1.0 / X.shape[2]
                a_sq += (scale_a * _gram_norm(X)) ** 2
                b_sq += _gram_norm(G) ** 2
                parts.append(("kron", (X, G, scale_a)))
            s = (input_clip / a_sq.sqrt().clamp_min(1e-300)).clamp(max=1.0)
            t = (curvature_clip / b_sq.sqrt().clamp_min(1e-300)).clamp(max=1.0)
            for k, (kind, part) in enumerate(parts):
                if kind == "diag":
                    sums = [(t[:, None] * d).sum(0) for d in part]
                    D[k] = sums if k not in D else [a + b for a, b in zip(D[k], sums)]
                    continue
                X, G, scale_a = part
                Xs, Gs = X * s.sqrt()[:, None, None], G * t.sqrt()[:, None, None]
                A[k] = A[k] + scale_a * torch.einsum("mis,mjs->ij", Xs, Xs)
                B[k] = B[k] + torch.einsum("mos,mps->op", Gs, Gs)
    cpu = lambda t: t.cpu() if torch.is_tensor(t) else t  # noqa: E731 (the noise is drawn on the CPU)
    return ([cpu(a) for a in A], [cpu(b) for b in B],
            [None if D.get(k) is None else [cpu(t) for t in D[k]] for k in range(len(layers))])


def _symmetric_noise(n: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """A symmetric ``(n, n)`` float64 matrix, its upper triangle (diagonal included) iid ``N(0, std²)``."""
    z = torch.randn(n, n, generator=generator, dtype=torch.float64) * std
    return torch.triu(z) + torch.triu(z, 1).T


def _psd(a: torch.Tensor) -> torch.Tensor:
    """The nearest positive semi-definite matrix (eigenvalues floored at 0): post-processing."""
    w, v = torch.linalg.eigh(0.5 * (a + a.T))
    return (v * w.clamp_min(0)) @ v.T


def private_kron(model: nn.Module, x: torch.Tensor, cfg: DPConfig, release_noise: float, n_released: int,
                 generator: torch.Generator, kfac: str = "expand", batch_size: int = 64) -> BlockDiag:
    """The released K-FAC curvature (module docstring): :func:`clipped_kron_sums` with Gaussian noise on every
    entry of each factor's upper triangle and of each diagonal — standard deviation ``release_noise · √2 ·`` the
    part's clip (input factors ``dp_input_clip``, output factors and diagonals ``dp_curvature_clip``: two parts of
    one release, each of sensitivity its clip) — each factor made positive semi-definite, the diagonals floored at
    0, the input factors divided by the released size ``n_released``; blocks as :func:`fast_kron`'s."""
    A, B, D = clipped_kron_sums(model, x, cfg.dp_input_clip, cfg.dp_curvature_clip, kfac, batch_size)
    std_a = release_noise * math.sqrt(2.0) * cfg.dp_input_clip
    std_b = release_noise * math.sqrt(2.0) * cfg.dp_curvature_clip
    layers = captured_layers(model)
    for k, layer in enumerate(layers):
        if isinstance(layer, SUPPORTED_LAYERS):
            A[k] = _psd(A[k] + _symmetric_noise(A[k].shape[0], std_a, generator)) / max(1, n_released)
            B[k] = _psd(B[k] + _symmetric_noise(B[k].shape[0], std_b, generator))
        else:
            D[k] = [(d + std_b * torch.randn(d.shape, generator=generator, dtype=torch.float64)).clamp_min(0)
                    for d in D[k]]
    return kron_blocks(model, layers, A, B, D)
