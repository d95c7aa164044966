"""The capture's layer policy: which block each parameter gets for a structure (recorded per
parameter in the artifact's ``curvature_blocks``), and the K-FAC variants for weight-shared layers."""

from __future__ import annotations

import torch
from torch import nn

from posterior_fusion import choices
from posterior_fusion.models.layers import DIAG_LAYERS, SUPPORTED_LAYERS, owns_curvature

# the fast capture's passes per `capture_dtype` (posterior_fusion.choices): the model's type, or autocast
AUTOCAST_DTYPES = dict(zip(choices.CAPTURE_DTYPES, (None, torch.bfloat16), strict=True))


BLOCK_POLICY = {
    "kron": "Linear/Conv2d weight: K-FAC (Kron); its bias: Dense",
    "kron-expand": "an attention key projection under kfac reduce: K-FAC expand (reduce's output factor vanishes "
                   "there: a softmax row ignores a shift of its scores); its bias: Dense",
    "diag": "diagonal GGN from per-sample gradients",
    "residual": "no layer rule (a table used directly, position embeddings, a bare Parameter): the exact GGN "
                "diagonal from its per-sample gradients",
    "prior": "no curvature captured (zero block: the prior alone; a private fit's residual parameters)",
}
"""What each parameter's block holds (recorded per parameter in the artifact's ``curvature_blocks``)."""


def expanded_under_reduce(model: nn.Module) -> set[nn.Module]:
    """The layers K-FAC-reduce cannot take: every attention key projection (``LinearAttention.k_proj``). Summed
    over the keys, the gradient of a softmax row's scores vanishes (the row ignores a shift), so reduce's output
    factor of the key weights is rounding noise and they would get the prior alone; they are captured with
    expand instead (``docs/methods.md``)."""
    from posterior_fusion.models.attention import LinearAttention

    return {m.k_proj for m in model.modules() if isinstance(m, LinearAttention)}


def block_policy(model: nn.Module, structure: str, kfac: str = "expand") -> list[tuple[str, str]]:
    """``(parameter name, block)`` in ``model.parameters()`` order, block a key of :data:`BLOCK_POLICY`
    (``structure`` kron: Linear/Conv2d weights ``kron``, their biases ``dense``; diag: ``diag``;
    normalisation layers and per-sample embeddings ``diag`` under every structure, once the
    embeddings are flagged on an example, :func:`~posterior_fusion.models.layers.unsupported_reason`)."""
    out = []
    expanded = expanded_under_reduce(model) if structure == "kron" and kfac == "reduce" else set()
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if isinstance(module, SUPPORTED_LAYERS):
                weight = "kron-expand" if module in expanded else "kron"
                kind = (weight if pname == "weight" else "dense") if structure == "kron" else "diag"
            elif isinstance(module, DIAG_LAYERS) and owns_curvature(module):
                kind = "diag"
            else:
                kind = "residual"
            out.append((name, kind))
    return out


def curvature_bytes(model: nn.Module, structure: str) -> int:
    """The float32 bytes one component's curvature takes in an artifact, from the model's shapes alone
    (before training): a Kronecker weight block its two factors (out², in² with in = in_channels·kernel
    for a convolution), its bias block out², a diagonal block one float per parameter, a prior-only
    block nothing; ``diag+full`` adds the last Linear layer's dense block ((weights + biases)²)."""
    total = 0
    last = None
    for _, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(module, SUPPORTED_LAYERS) and structure == "kron":
                out = p.shape[0]
                total += out * out + (p[0].numel() ** 2 if pname == "weight" else 0)
            else:  # a diagonal block: layer rules, normalisation, embeddings and the residual parameters alike
                total += p.numel()
        if isinstance(module, nn.Linear):
            last = module
    if structure == "diag+full" and last is not None:
        n = sum(p.numel() for p in last.parameters())
        total += n * n
    return 4 * total
