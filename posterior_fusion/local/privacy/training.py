"""Private training (:mod:`posterior_fusion.local.privacy`): DP-SGD through Opacus for the components, the
clipped per-sample gradients of the refresh round, and FedPPD's private chain and student."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from posterior_fusion.errors import ConfigError
from posterior_fusion.local.fit_config import DPConfig
from posterior_fusion.local.privacy.accounting import DPPass, DPPlan
from posterior_fusion.local.train import SwagCollector, prior_centres, training_diverged
from posterior_fusion.posterior import SwagMoments


def per_sample_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(M, d)``: each sample's gradient of its cross-entropy, in ``model.parameters()`` order (torch.func)."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g[k].reshape(len(x), -1) for k in params], 1)


def clipped_gradient_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float,
                         batch_size: int = 64) -> torch.Tensor:
    """``Σ_n clip(∇ℓ_n)`` ``(d,)`` float64: each sample's gradient scaled to L2 norm at most ``clip``, so adding
    or removing one sample moves the sum by at most ``clip`` (its L2 sensitivity)."""
    model.eval()
    total = None
    for i in range(0, len(x), batch_size):
        g = per_sample_gradients(model, x[i: i + batch_size], y[i: i + batch_size]).double()
        part = (g * (clip / g.norm(dim=1).clamp_min(1e-300)).clamp(max=1.0)[:, None]).sum(0)
        total = part if total is None else total + part
    return total


def private_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, noise_multiplier: float,
                     generator: torch.Generator, batch_size: int = 64) -> torch.Tensor:
    """The Gaussian mechanism on :func:`clipped_gradient_sum`: noise ``noise_multiplier · clip`` on every
    coordinate, ``(d,)`` float64."""
    total = clipped_gradient_sum(model, x, y, clip, batch_size).cpu()  # the noise is drawn on the CPU
    return total + noise_multiplier * clip * torch.randn(total.shape, generator=generator, dtype=torch.float64)


def _opacus(model: nn.Module, optimizer: torch.optim.Optimizer, plan_: DPPlan, clip: float, batch_size: int,
            noise: torch.Generator):
    """``model`` wrapped for per-sample gradients and ``optimizer`` for Opacus' clipping and noise (of standard
    deviation ``noise_multiplier · clip`` on the sum, divided by ``batch_size``, the expected Poisson batch), the
    noise drawn from ``noise`` — a generator seeded from the operating system's entropy by the caller, never from
    a recorded seed (a noise sequence someone can replay protects nothing)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ConfigError(f"`dp_epsilon`: Opacus cannot train this model privately ({str(errors[0])[:160]})")
    gsm = GradSampleModule(model)
    opt = DPOptimizer(optimizer, noise_multiplier=plan_.noise_multiplier, max_grad_norm=clip,
                      expected_batch_size=max(1, batch_size), generator=noise)
    return gsm, opt


def _noisy_gradient(opt, params: list[torch.Tensor], loss: Callable[[torch.Tensor], torch.Tensor],
                    take: torch.Tensor) -> None:
    """Opacus' private gradient into every ``p.grad``: ``loss(take)`` (a mean over the Poisson batch ``take``
    ``(n,)`` bool) backpropagated, each sample's gradient clipped, the sum noised and divided by the expected
    batch; an empty batch still takes its noisy step (the accountant counts it)."""
    opt.zero_grad(set_to_none=True)
    if take.any():
        loss(take).backward()
    else:
        for p in params:
            p.grad_sample = torch.zeros(1, *p.shape, dtype=p.dtype, device=p.device)
    opt.pre_step()


def _poisson(n: int, rate: float, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=gen) < rate


def private_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train_cfg, dp: DPConfig, plan_: DPPlan,
                  weight_decay: float, seed: int, noise: torch.Generator, prior_mean: torch.Tensor | None = None,
                  soft_targets: torch.Tensor | None = None, soft_weight: float = 0.0,
                  sample_rate: float | None = None) -> SwagMoments | None:
    """DP-SGD on ``model`` in place (module docstring): Opacus' per-sample clipping and noise (drawn from
    ``noise``), Poisson batches at ``sample_rate`` (default ``plan_.sample_rate``; ``seed`` draws them),
    ``train_cfg.epochs`` epochs of about n / batch steps; SGD (or Adam, ``optimizer`` adam / adamw) with the
    configuration's learning rate and momentum (Adam's β1);
    the decay toward ``prior_mean`` (zero by default) after each step. With ``soft_targets`` ``(n, classes)`` (a
    private teacher's probabilities on the silo, HBFL) each sample's loss is ``(1 − soft_weight) · CE(y) +
    soft_weight · CE(soft_targets)``: still one sample's term, clipped as a whole. Returns the SWAG moments of the
    private iterates when ``train_cfg.swag`` asks for them (post-processing: DP-SGD's guarantee covers every
    iterate), else None."""
    rate = plan_.sample_rate if sample_rate is None else sample_rate
    batch = max(1, round(rate * len(x)))
    inner = (torch.optim.SGD(model.parameters(), lr=train_cfg.lr, momentum=train_cfg.momentum)
             if train_cfg.optimizer == "sgd" else
             torch.optim.Adam(model.parameters(), lr=train_cfg.lr, betas=(train_cfg.momentum, 0.999)))
    gsm, opt = _opacus(model, inner, plan_, dp.dp_clip, batch, noise)
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    centres = prior_centres(params, prior_mean)
    steps = math.ceil(len(x) / batch)

    def loss(take: torch.Tensor) -> torch.Tensor:
        out = gsm(x[take])
        value = nn.functional.cross_entropy(out, y[take])
        if soft_targets is not None and soft_weight > 0:
            soft = -(soft_targets[take] * torch.log_softmax(out, -1)).sum(-1).mean()
            value = (1 - soft_weight) * value + soft_weight * soft
        return value

    swag = SwagCollector(train_cfg, steps)
    gsm.train()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus' hooks, the first layer
        for epoch in range(train_cfg.epochs):
            for step in range(steps):
                _noisy_gradient(opt, params, loss, _poisson(len(x), rate, gen).to(x.device))
                opt.original_optimizer.step()
                with torch.no_grad():
                    for p, c in zip(params, centres):
                        p.sub_(train_cfg.lr * weight_decay * (p - c))
                swag.after_step(gsm, epoch, step)
            if not bool(torch.isfinite(parameters_to_vector(params)).all()):  # once per epoch, as train_map
                raise training_diverged("DP-SGD", epoch, train_cfg, "a weight is not finite")
    gsm._close()
    model.eval()
    return swag.moments()


def ppd_passes(ppd, n: int, components: int) -> tuple[DPPass, DPPass]:
    """FedPPD's two gradient passes over the silo under ``dp`` (:func:`private_ppd`), over all ``components``: the
    SGLD chain's ``ppd_steps`` and the student's one step per kept sample, each on its own Poisson batch at
    ``ppd_batch_size / n``."""
    rate = min(1.0, ppd.batch_size / n)
    kept = len(range(ppd.burn_in, ppd.steps, ppd.thin))
    return DPPass("ppd chain", rate, components * ppd.steps), DPPass("ppd student", rate, components * kept)


def private_ppd(build: Callable[[], nn.Module], start: torch.Tensor, x: torch.Tensor, y: torch.Tensor, ppd,
                dp: DPConfig, plan_: DPPlan, prior_precision: float, temperature: float, seed: int,
                noise: torch.Generator, prior_mean: torch.Tensor | None = None,
                show_progress: bool = True) -> tuple[torch.Tensor, dict]:
    """FedPPD's client step under ``dp`` (:mod:`posterior_fusion.local.ppd` without privacy): the student ``(d,)``
    and a record.

    The chain: each step a Poisson batch at q = ``ppd_batch_size / n``; Opacus clips each sample's gradient of its
    cross-entropy to ``dp_clip`` and adds ``N(0, (σ·clip)²)`` to the sum (σ the plan's noise multiplier); the sum
    over the silo is estimated as that over q, so ``∇U = ĝ / (q T) + λ0 (θ − centre)`` and
    ``θ ← θ − (ε/2) ∇U + ξ``. The mechanism's noise already moves θ by ``(ε/2) σ·clip / (q T)`` per coordinate; ξ
    tops the Langevin noise up to variance ε (none when the mechanism's exceeds it: the chain is then hotter than
    the posterior, recorded as ``ppd_chain_excess_noise``). The student: one Opacus step per kept sample on its
    own Poisson batch, the per-sample loss the cross-entropy between the chain's predictive and the student's on
    the perturbed inputs (the chain is private: its predictive is post-processing). Both passes are in the plan
    (:func:`ppd_passes`)."""
    from torch.nn.utils import vector_to_parameters

    from posterior_fusion.local.ppd import chain_diverged
    from posterior_fusion.progress import progress

    ppd.validate()
    chain, student_pass = plan_.pass_of("ppd chain"), plan_.pass_of("ppd student")
    rate, n = chain.sample_rate, len(x)
    gen = torch.Generator().manual_seed(seed)
    teacher, student = build(), build()
    device = next(teacher.parameters()).device
    for net in (teacher, student):
        vector_to_parameters(start.detach().to(device).clone(), net.parameters())
        net.train()
    t_params, s_params = list(teacher.parameters()), list(student.parameters())
    centres = prior_centres(t_params, prior_mean)
    t_gsm, t_opt = _opacus(teacher, torch.optim.SGD(t_params, lr=1.0), plan_, dp.dp_clip, ppd.batch_size, noise)
    s_gsm, s_opt = _opacus(student, torch.optim.SGD(s_params, lr=ppd.student_lr, momentum=0.9), plan_, dp.dp_clip,
                           ppd.batch_size, noise)
    mechanism_sd = 0.5 * ppd.step_size * plan_.noise_multiplier * dp.dp_clip / (rate * temperature)
    langevin_sd = math.sqrt(max(0.0, ppd.step_size - mechanism_sd ** 2))

    def chain_loss(take: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(t_gsm(x[take]), y[take])

    def student_loss(take: torch.Tensor) -> torch.Tensor:
        xp = x[take]
        xp = xp + ppd.perturb * torch.randn(xp.shape, generator=gen, dtype=xp.dtype).to(device)
        with torch.no_grad():
            target = torch.softmax(teacher(xp), -1)
        return -(target * torch.log_softmax(s_gsm(xp), -1)).sum(-1).mean()

    kept = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for step in progress(range(ppd.steps), "ppd (private sgld + distill)", show=show_progress):
            _noisy_gradient(t_opt, t_params, chain_loss, _poisson(n, rate, gen).to(device))
            with torch.no_grad():  # p.grad: the noisy clipped sum / batch; n · p.grad estimates the silo's sum
                for p, c in zip(t_params, centres):
                    grad_u = p.grad * (ppd.batch_size / rate) / temperature + prior_precision * (p - c)
                    xi = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(device) * langevin_sd
                    p.add_(-0.5 * ppd.step_size * grad_u + xi)
            if (step % 100 == 99 or step == ppd.steps - 1) and not bool(torch.isfinite(parameters_to_vector(t_params)).all()):
                chain_diverged(step, ppd.step_size, n, temperature)  # checked as the plain chain is
            if step >= ppd.burn_in and (step - ppd.burn_in) % ppd.thin == 0:
                _noisy_gradient(s_opt, s_params, student_loss, _poisson(n, student_pass.sample_rate, gen).to(device))
                s_opt.original_optimizer.step()
                kept += 1
    t_gsm._close()
    s_gsm._close()
    return parameters_to_vector(student.parameters()).detach().cpu().clone(), \
        {"samples": kept, "chain_excess_noise": round(max(0.0, mechanism_sd ** 2 / ppd.step_size - 1.0), 6)}
