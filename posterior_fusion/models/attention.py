"""``nn.MultiheadAttention`` as four ``nn.Linear`` maps, so the fast capture and the structured GLM see
attention as they see any layer: its query, key, value and output projections are linear maps shared over
the sequence (K-FAC with weight sharing over tokens, expand or reduce — Eschenhagen et al. 2023), and the
attention softmax's own curvature stays inside the GGN through the output Jacobian as for any other
layer. :func:`linear_attention` swaps every ``nn.MultiheadAttention`` of a model for a
:class:`LinearAttention` computing the same function from the same weights (PyTorch's packed
``in_proj_weight`` split into ``q_proj``, ``k_proj``, ``v_proj``); :meth:`ModelSpec.build` applies it, so
a stock ``nn.TransformerEncoderLayer`` / ``DecoderLayer`` is captured on the fast path. The parameters are
then named ``…self_attn.q_proj.weight`` etc.; :func:`packed_names` maps a stock state dict's packed names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from posterior_fusion.errors import ModelSpecError


class LinearAttention(nn.Module):
    """Multi-head scaled dot-product attention with ``nn.Linear`` projections; the call signature and
    results of ``nn.MultiheadAttention`` (``(output, attention weights or None)``, ``batch_first`` as the
    module it replaces, ``key_padding_mask`` / ``attn_mask`` boolean (True: not attended) or additive,
    ``is_causal``). Its ``in_proj_bias`` is None and ``_qkv_same_embed_dim`` False, so PyTorch's
    transformer layers take their standard (not the fused native) path through it."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ModelSpecError("nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported")
        E, bias = mha.embed_dim, mha.in_proj_bias is not None
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = E, mha.num_heads, mha.dropout, mha.batch_first
        self.head_dim = E // mha.num_heads
        like = {"device": mha.out_proj.weight.device, "dtype": mha.out_proj.weight.dtype}  # mha's, not the defaults
        self.q_proj = nn.Linear(E, E, bias=bias, **like)
        self.k_proj = nn.Linear(mha.kdim, E, bias=bias, **like)
        self.v_proj = nn.Linear(mha.vdim, E, bias=bias, **like)
        self.out_proj = nn.Linear(E, E, bias=mha.out_proj.bias is not None, **like)
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                weights = mha.in_proj_weight.chunk(3)
            else:
                weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
            biases = mha.in_proj_bias.chunk(3) if bias else (None, None, None)
            for proj, w, b in zip((self.q_proj, self.k_proj, self.v_proj), weights, biases):
                proj.weight.copy_(w)
                if b is not None:
                    proj.bias.copy_(b)
            self.out_proj.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                self.out_proj.bias.copy_(mha.out_proj.bias)
        self.in_proj_bias = None  # PyTorch's layers test these to choose their fused path: not with this module
        self._qkv_same_embed_dim = False

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``query`` ``(B, T, E)`` (``(T, B, E)`` unless ``batch_first``; ``(T, E)`` unbatched), ``key`` /
        ``value`` ``(B, S, ·)``: the attended output in the same layout, and the weights ``(B, T, S)``
        (per head ``(B, H, T, S)`` without ``average_attn_weights``) where ``need_weights``."""
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, T, _ = query.shape
        S, H, D = key.shape[1], self.num_heads, self.head_dim
        q = self.q_proj(query).reshape(B, T, H, D).transpose(1, 2)
        k = self.k_proj(key).reshape(B, S, H, D).transpose(1, 2)
        v = self.v_proj(value).reshape(B, S, H, D).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, T, S)
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(T, S, dtype=torch.bool, device=query.device).triu(1)
        for mask in (attn_mask, key_padding_mask):
            if mask is None:
                continue
            if mask is key_padding_mask:
                mask = mask[:, None, None, :]  # (B, 1, 1, S)
            elif mask.dim() == 3:
                mask = mask.reshape(B, H, T, S)
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(mask, float("-inf"))
            else:
                scores = scores + mask.to(scores.dtype)
        attn = torch.softmax(scores, dim=-1)
        dropped = F.dropout(attn, self.dropout, self.training) if self.dropout > 0 else attn
        out = self.out_proj((dropped @ v).transpose(1, 2).reshape(B, T, self.embed_dim))
        if unbatched:
            out = out[0]
        elif not self.batch_first:
            out = out.transpose(0, 1)
        weights = (attn.mean(1) if average_attn_weights else attn) if need_weights else None
        if weights is not None and unbatched:
            weights = weights[0]
        return out, weights


def linear_attention(model: nn.Module) -> nn.Module:
    """``model`` with every ``nn.MultiheadAttention`` replaced by a :class:`LinearAttention` of the same
    weights (in place; returned for chaining)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.MultiheadAttention):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, LinearAttention(module))
    return model


def packed_names(model: nn.Module) -> dict[str, tuple[str, int]]:
    """For a model built with :class:`LinearAttention`: each projection parameter's name → (the stock
    ``nn.MultiheadAttention``'s packed name, which third of it), e.g. ``a.q_proj.weight`` →
    (``a.in_proj_weight``, 0), so a stock state dict can be read into it."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearAttention):
            prefix = f"{name}." if name else ""
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{prefix}{proj}.weight"] = (f"{prefix}in_proj_weight", i)
                if getattr(module, proj).bias is not None:
                    out[f"{prefix}{proj}.bias"] = (f"{prefix}in_proj_bias", i)
    return out
