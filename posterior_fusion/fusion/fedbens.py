"""FedBEns (Talpini et al.): modes of the product of client mixtures over the over-counted prior.

    log p(w | D) = Σ_c [ log q_c(w) − log p0_c(w) ] + log p0(w) + const
    q_c(w) = Σ_m π_cm N(w; ŵ_cm, Λ_cm⁻¹),   Λ_cm = G_cm / T_c + λ0_c I

The server runs one Adam optimisation per mode index m, started at the element-wise median
over clients of ŵ_cm, and keeps the best validation iterate (else the best objective). The
M runs are batched: the parameters are a ``(M, d)`` tensor with per-row gradient clipping,
which is the same as M independent Adam runs.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.common import (
    FusionInputs,
    FusionResult,
    accuracy_of,
    require_equal_components,
)
from posterior_fusion.fusion.stack import StackedGaussians

LOG_2PI = math.log(2 * math.pi)


class GlobalLogPosterior:
    """Negative global log posterior ``−log p(w | D)`` (up to a constant) for ``W`` ``(K, d)``."""

    def __init__(self, clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                 server_prior_precision: float, dtype: torch.dtype = torch.float32, lowrank_tol: float = 0.0,
                 kernel: str | None = None, device: str = "cpu") -> None:
        comps, scales, shifts, self.groups = [], [], [], []
        for c, t, lam in zip(clients, temperatures, prior_precisions):
            start = len(comps)
            comps.extend(c.components)
            scales.extend([1.0 / t] * c.num_components)
            shifts.extend([lam] * c.num_components)
            self.groups.append((start, len(comps)))
        self.stack = StackedGaussians(comps, scales, shifts, dtype, lowrank_tol, kernel).to(device)
        d = self.stack.dim
        self.d = d
        log_pi = torch.cat([torch.log(c.weights).to(dtype) for c in clients])
        # Normalised log N(w; ŵ, Λ⁻¹) = log π + ½ log|Λ| − d/2 log 2π − ½ q
        self.log_norm = log_pi.to(device) + 0.5 * self.stack.logdets - 0.5 * d * LOG_2PI  # (N,)
        self.client_lams = torch.tensor(prior_precisions, dtype=dtype)
        self.lam0 = float(server_prior_precision)

    def log_prior(self, sq_norm: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
        lam = torch.as_tensor(lam, dtype=sq_norm.dtype)
        return 0.5 * self.d * torch.log(lam) - 0.5 * self.d * LOG_2PI - 0.5 * lam * sq_norm

    def __call__(self, W: torch.Tensor) -> torch.Tensor:
        """``(K, d)`` -> ``(K,)`` values of ``−log p(w | D)``."""
        log_comp = self.log_norm[None] - 0.5 * self.stack.quadratic_forms(W)  # (K, N)
        sq = W.square().sum(-1)
        total = self.log_prior(sq, self.lam0)
        for (a, b), lam in zip(self.groups, self.client_lams):
            total = total + torch.logsumexp(log_comp[:, a:b], dim=-1) - self.log_prior(sq, lam)
        return -total


def median_starts(inputs: FusionInputs, modes: int) -> torch.Tensor:
    """``(modes, d)``: element-wise median over clients of ŵ_cm for each mode index m."""
    return torch.stack([inputs.mode_maps(m).median(dim=0).values for m in range(modes)])


def optimise_modes(objective, W0: torch.Tensor, inputs: FusionInputs, desc: str) -> tuple[torch.Tensor, list[list[dict]]]:
    """Adam on ``objective`` from each row of ``W0`` ``(K, d)`` with per-row clipping.

    Keeps, per row, the iterate with the best validation accuracy (evaluated at step 0, every
    ``val_every`` steps and at the last step) if validation data is given, else the iterate
    with the lowest objective. Returns ``(best (K, d), history per row)``.
    """
    opts = inputs.options
    W = W0.clone().to(opts.device).requires_grad_(True)
    adam = torch.optim.Adam([W], lr=opts.lr)
    K = W.shape[0]
    best = W0.clone()
    best_score = torch.full((K,), -math.inf)
    history: list[list[dict]] = [[] for _ in range(K)]

    def consider(step: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            if inputs.val is not None:
                if step % opts.val_every != 0 and step != opts.steps:
                    return
                score = accuracy_of(inputs.spec, W.detach().cpu(), inputs.val)
            else:
                score = -values
            for k in range(K):
                entry = {"step": step, "objective": float(values[k])}
                if inputs.val is not None:
                    entry["val_accuracy"] = float(score[k])
                if inputs.val is not None or step % opts.val_every == 0 or step == opts.steps:
                    history[k].append(entry)
            score = score.cpu()
            improved = score > best_score
            best[improved] = W.detach().cpu()[improved]
            best_score[improved] = score[improved]

    bar = tqdm(range(opts.steps + 1), desc=desc, leave=False, disable=None if opts.progress else True)
    for step in bar:
        values = objective(W)
        consider(step, values.detach().cpu())
        if step == opts.steps:
            break
        adam.zero_grad(set_to_none=True)
        values.sum().backward()
        with torch.no_grad():
            norms = W.grad.norm(dim=1, keepdim=True)
            W.grad.mul_(torch.clamp(opts.clip / (norms + 1e-12), max=1.0))
        adam.step()
        bar.set_postfix(objective=f"{values.mean().item():.4g}")
    return best, history


def fedbens(inputs: FusionInputs) -> FusionResult:
    """FedBEns on any curvature structure (kron, diag, diag+full)."""
    m = require_equal_components(inputs, "fedbens")
    modes = inputs.options.modes or m
    if modes > m:
        raise ConfigError(f"--modes {modes} exceeds the clients' number of mixtures {m}")
    objective = GlobalLogPosterior(
        inputs.clients, [inputs.temperature(c) for c in inputs.clients],
        [inputs.prior_precision(c) for c in inputs.clients], inputs.server_prior_precision(),
        lowrank_tol=inputs.options.lowrank_tol, kernel=inputs.options.kernel, device=inputs.options.device)
    best, history = optimise_modes(objective, median_starts(inputs, modes), inputs, "fedbens")
    return FusionResult([w.clone() for w in best], {"history": history, "kron_ranks": objective.stack.ranks})
