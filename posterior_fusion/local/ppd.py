"""FedPPD's client step (paper ``002``, section 2.1; Bayesian Dark Knowledge, Korattikara Balan
et al. 2015): SGLD samples from the client's tempered posterior, distilled online into one
"student" network that represents the client's posterior predictive distribution (PPD).

SGLD (Welling & Teh 2011) on U(θ) = (n / b) Σ_batch ℓ(θ) / T + λ0/2 ‖θ − θ0‖², with ℓ the negative
log-likelihood of one sample: θ ← θ − (ε/2) ∇U(θ) + N(0, ε I). After ``burn_in`` steps, every
``thin``-th iterate is a posterior sample; each sample is "injected" into the student by one SGD
step on the cross-entropy between the sample's predictive p(y|x', θ) and the student's on a
perturbed input batch x' = x + N(0, ``perturb``²) (the paper's unlabeled distillation set
D'_k). The chain is warm-started from the component's MAP; θ0 is the prior's centre (zero, or the pretrained
base a silo fine-tunes). Under ``dp`` the chain and the student run through Opacus instead
(:func:`posterior_fusion.local.privacy.training.private_ppd`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion.errors import ConfigError
from posterior_fusion.local.fit_config import PPDConfig
from posterior_fusion.local.train import prior_centres
from posterior_fusion.progress import progress


def sgld(model: nn.Module, neg_log_lik: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
         x: torch.Tensor, y: torch.Tensor, steps: int, step_size: float, prior_precision: float,
         temperature: float = 1.0, batch_size: int = 64, burn_in: int = 0, thin: int = 1,
         generator: torch.Generator | None = None,
         on_sample: Callable[[int, nn.Module, torch.Tensor, torch.Tensor], None] | None = None,
         desc: str = "sgld", show_progress: bool = True, prior_mean: torch.Tensor | None = None) -> int:
    """Run SGLD on ``model`` in place; ``neg_log_lik(model, xb, yb)`` is the *summed* negative
    log-likelihood of a batch. Calls ``on_sample(k, model, xb, yb)`` for every kept iterate
    (after ``burn_in``, every ``thin``-th) with the batch of that step; returns the number kept.
    ``prior_mean`` ``(d,)`` over the trainable parameters: the prior's centre (zero when None)."""
    n = x.shape[0]
    params = [p for p in model.parameters() if p.requires_grad]
    centres = prior_centres(params, prior_mean)
    kept = 0
    order = torch.randperm(n, generator=generator)
    pos = 0
    for step in progress(range(steps), desc, show=show_progress):
        if pos + batch_size > n:
            order, pos = torch.randperm(n, generator=generator), 0
        idx = order[pos : pos + batch_size].to(x.device)
        pos += batch_size
        xb, yb = x[idx], y[idx]
        model.zero_grad(set_to_none=True)
        U = neg_log_lik(model, xb, yb) * (n / len(idx)) / temperature
        U = U + 0.5 * prior_precision * sum((p - c).square().sum() for p, c in zip(params, centres))
        U.backward()
        if (step % 100 == 99 or step == steps - 1) and not bool(torch.isfinite(U)):
            chain_diverged(step, step_size, n, temperature)
        with torch.no_grad():
            for p in params:
                noise = torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) * step_size**0.5
                p.add_(-0.5 * step_size * p.grad + noise)
        if step >= burn_in and (step - burn_in) % thin == 0:
            if on_sample is not None:
                on_sample(kept, model, xb, yb)
            kept += 1
    if not all(bool(torch.isfinite(p).all()) for p in params):
        chain_diverged(steps - 1, step_size, n, temperature)
    return kept


def chain_diverged(step: int, step_size: float, n: int, temperature: float) -> None:
    """One line for an SGLD chain that left the finite numbers by step ``step`` (from 0), naming a step size."""
    raise ConfigError(f"the SGLD chain diverged by step {step + 1}: `ppd_step_size` {step_size:g} is too large for "
                      f"this silo (the drift scales with n / T = {n / temperature:.3g}); try a step size near "
                      f"{0.01 * temperature / n:.1g} (0.01·T/n)")


def _cross_entropy_sum(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(xb), yb, reduction="sum")


def distil_ppd(build: Callable[[], nn.Module], start: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               cfg: PPDConfig, prior_precision: float, temperature: float, seed: int = 0,
               show_progress: bool = True, prior_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The PPD student ``(d,)`` of an SGLD chain started at ``start`` (both networks built by
    ``build``: the student has the teacher's architecture), and a record of the run; the prior
    N(``prior_mean``, λ0⁻¹ I) (zero-centred when None)."""
    cfg.validate()
    gen = torch.Generator().manual_seed(seed)
    teacher, student = build(), build()
    device = next(teacher.parameters()).device
    vector_to_parameters(start.detach().to(device).clone(), teacher.parameters())
    vector_to_parameters(start.detach().to(device).clone(), student.parameters())
    teacher.train()
    student.train()
    opt = torch.optim.SGD(student.parameters(), lr=cfg.student_lr, momentum=0.9)

    def inject(k: int, model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> None:
        xp = xb + cfg.perturb * torch.randn(xb.shape, generator=gen, dtype=xb.dtype).to(xb.device)
        with torch.no_grad():
            target = torch.softmax(model(xp), -1)
        loss = -(target * torch.log_softmax(student(xp), -1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    kept = sgld(teacher, _cross_entropy_sum, x, y, cfg.steps, cfg.step_size, prior_precision, temperature,
                cfg.batch_size, cfg.burn_in, cfg.thin, gen, inject, "ppd (sgld + distill)", show_progress,
                prior_mean)
    return parameters_to_vector(student.parameters()).detach().cpu().clone(), {"samples": kept}
