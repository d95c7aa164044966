"""Curvature for the parameters no layer rule covers: a learned table used directly (``pos.weight`` added to the
inputs), an ``nn.Embedding`` called with position ids, any other ``nn.Parameter``. Their exact GGN (or MC
Fisher) diagonal, ``Σ_n Σ_r (J_nᵀ s_nr)²`` with ``s_nr`` the back-propagated columns of
:func:`~posterior_fusion.models.jacobians.backprop_columns`, from per-sample gradients of those parameters alone
(``torch.func``: one vmapped backward per column and batch), so they get the data's curvature instead of the
prior alone."""

from __future__ import annotations

import torch
from torch import nn

from posterior_fusion.models.jacobians import backprop_columns


def residual_names(model: nn.Module, policy: list[tuple[str, str]]) -> list[str]:
    """The parameters ``policy`` (:func:`~posterior_fusion.local.capture.policy.block_policy`) leaves without a
    layer rule (kind ``residual``), by name."""
    return [name for name, kind in policy if kind == "residual"]


def residual_diagonal(model: nn.Module, x: torch.Tensor, names: list[str], batch_size: int = 64,
                      ggn: str = "exact", generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The GGN diagonal of each parameter in ``names`` ``{name: (numel,) float64}`` on the inputs ``x`` ``(n, ...)``,
    the model in evaluation mode (module doc)."""
    from torch.func import functional_call, grad, vmap

    if not names:
        return {}
    params = {k: v.detach() for k, v in model.named_parameters()}
    wanted = {k: params[k] for k in names}
    rest = {k: v for k, v in params.items() if k not in wanted}
    out = {k: torch.zeros(v.numel(), dtype=torch.float64, device=v.device) for k, v in wanted.items()}
    was = model.training
    model.eval()

    def one(sub, xi, si):
        return (functional_call(model, {**rest, **sub}, (xi[None],))[0] * si).sum()

    try:
        for i in range(0, x.shape[0], batch_size):
            xb = x[i: i + batch_size]
            with torch.no_grad():
                cols = backprop_columns(functional_call(model, params, (xb,)), ggn, generator)  # (R, b, C)
            for r in range(cols.shape[0]):
                g = vmap(grad(one), in_dims=(None, 0, 0))(wanted, xb, cols[r].to(xb.dtype if xb.is_floating_point()
                                                                                  else cols.dtype))
                for k in out:
                    out[k] += g[k].reshape(xb.shape[0], -1).double().square().sum(0)
    finally:
        model.train(was)
    return out
