"""Differentially private client artifacts (``fit-local --dp-epsilon E``): every quantity of the release that
depends on the silo's data goes through a mechanism, and one accountant composes them into the (ε, δ) asked
for. Under add/remove-one-sample neighbouring:

- **training** of each of the M components: DP-SGD through Opacus (per-sample gradients of a
  ``GradSampleModule``, each clipped to ``dp_clip`` in L2, Gaussian noise of standard deviation
  ``noise_multiplier · clip`` on their sum, batches drawn by Poisson sampling at rate q = batch / n); the
  weight decay toward the prior's centre is data-independent and applied after each noisy step;
- **curvature**, structure ``diag``: each sample's contribution to the exact GGN diagonal,
  ``c_n = Σ_r (J_nᵀ s_nr)²`` (s_nr the columns of a square root of the cross-entropy Hessian), is clipped to
  ``dp_curvature_clip`` in L2, so adding or removing a sample moves the sum by at most ``dp_curvature_clip`` (its
  L2 sensitivity); Gaussian noise of standard deviation ``release_noise · curvature_clip`` on every
  coordinate; negative values set to 0 (post-processing). One release per component;
- **curvature**, structure ``kron`` (:func:`private_kron`): each sample's contributions to every layer's input
  factor (``A_n = X_n X_nᵀ / S`` expand, ``ū_n ū_nᵀ`` reduce; X_n its input patches over the S shared
  positions) are scaled together to Frobenius norm at most ``dp_input_clip``, its contributions to every output
  factor (``B_n = Σ_r G_nr G_nrᵀ`` over the C − 1 columns of the exact GGN) and to the normalisation layers'
  diagonals together to at most ``dp_curvature_clip``; the factors are summed unnormalised (dividing by n, a
  quantity of the data, would couple every entry to one sample), so adding or removing one sample moves the two
  parts by at most their clips. The Gaussian mechanism on both parts at once (sensitivity √2 in units of the
  clips: noise ``release_noise · √2 · clip`` on every entry of each factor's upper triangle, mirrored), each
  factor made positive semi-definite, the input factors divided by the released n (post-processing). One release
  per component;
- **curvature**, structure ``diag+full`` (:func:`private_diag_full`): each sample's contribution to the GGN
  diagonal of every parameter but the last ``nn.Linear``'s, ``c_n``, and to that layer's full block,
  ``G_n = H_n ⊗ φ̃_n φ̃_nᵀ`` (``H_n`` the cross-entropy Hessian at its logits, ``φ̃_n`` the layer's input with a 1
  for the bias; ``‖G_n‖_F = ‖H_n‖_F ‖φ̃_n‖²``), are scaled together to ``√(‖c_n‖² + ‖G_n‖_F²) ≤ dp_curvature_clip``;
  the released entries — the diagonal and the block's upper triangle, whose L2 norm is at most that — move by at
  most the clip. Gaussian noise ``release_noise · curvature_clip`` on each, mirrored; the diagonal floored at 0
  and the block made positive semi-definite (post-processing). One release per component;
- **class counts**: the histogram with Gaussian noise of standard deviation ``release_noise`` (sensitivity 1),
  rounded and floored at 0 (post-processing); ``n_data`` is their sum;
- **SWAG moments** (``swag``): the running moments of DP-SGD's own iterates, post-processing of the training's
  release (its guarantee covers every iterate): no further ε;
- **FedPPD** (``ppd``, :func:`private_ppd`): the SGLD chain's gradient and the student's distillation step each
  through Opacus on their own Poisson batches at ``ppd_batch_size / n`` (two more passes of subsampled Gaussian
  steps at the training's noise multiplier, recorded under ``passes``);
- **a private model** (``private_model``, HBFL): trained by DP-SGD as one more pass; its probabilities on each
  sample enter only that sample's loss in the shared model's DP-SGD, clipped with it;
- everything else the artifact holds is post-processing of these or data-independent (the MAPs, the
  temperature and prior, the input transform, the model); the data's SHA-256 and the training loss and
  accuracy are not recorded.

The accountant: Rényi DP (Opacus' ``compute_rdp``) of the subsampled Gaussian for all training steps and other
gradient passes plus the M + 1 full-batch Gaussian releases, converted to (ε, δ) once. ``dp_training_share`` of
ε calibrates the one noise multiplier of every gradient pass (at δ/2) and the rest the releases (at δ/2); both
noises are then scaled down together as far as the composed ε stays within the target; that composed ε is
recorded. The silo's size n sets the sampling rates (batch / n, as Opacus' Poisson sampler does) and the default
δ = 1/n: the accounting treats n as public; the class histogram, whose sum is the released ``n_data``, is not.

Every gradient noise is drawn from a generator seeded from the operating system's entropy, never from the
recorded training seed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from posterior_fusion.curvature import BlockDiag, Dense, Diag
from posterior_fusion.errors import ConfigError
from posterior_fusion.local.capture.fast import kron_blocks, last_layer_ggn
from posterior_fusion.local.capture.inputs import reduced_input
from posterior_fusion.local.capture.outputs import reduced_grad
from posterior_fusion.local.config import DPConfig
from posterior_fusion.local.train import SwagCollector, prior_centres, training_diverged
from posterior_fusion.models.jacobians import batch_pass, no_param_grads
from posterior_fusion.models.layers import (
    DIAG_LAYERS,
    SUPPORTED_LAYERS,
    captured_layers,
    embedding_per_sample,
    input_columns,
    norm_per_sample,
)
from posterior_fusion.posterior import SwagMoments


@dataclass(frozen=True)
class DPPass:
    """One more pass of subsampled Gaussian steps over the silo at the plan's ``noise_multiplier``: FedPPD's SGLD
    chain and its student's distillation, or HBFL's private model (``part`` names it)."""

    part: str
    sample_rate: float
    steps: int


@dataclass(frozen=True)
class DPPlan:
    """The mechanisms' parameters for one silo and what they compose to."""

    noise_multiplier: float  # DP-SGD's σ (times clip), of every gradient pass over the silo
    sample_rate: float       # q = batch / n (Poisson sampling) of the components' training
    steps: int               # DP-SGD steps over all components
    release_noise: float     # σ of the curvature (times curvature_clip) and count releases
    releases: int            # M curvature releases + 1 histogram
    delta: float
    epsilon: float           # the composed ε of all of it
    passes: tuple[DPPass, ...] = ()  # the other gradient passes (FedPPD, a private model), at noise_multiplier

    def pass_of(self, part: str) -> DPPass:
        """The recorded pass named ``part``."""
        return next(p for p in self.passes if p.part == part)

    def record(self, cfg: DPConfig, structure: str = "diag") -> dict:
        import opacus

        curvature = {"kron": "the clipped per-sample contributions to every K-FAC factor (input factors clipped to "
                             "input_clip, output factors and diagonals to curvature_clip)",
                     "diag+full": "the clipped per-sample GGN diagonal and last-layer block (clipped together to "
                                  "curvature_clip)"}.get(structure, "the clipped per-sample GGN diagonal")
        others = "".join(f", {p.part}" for p in self.passes)
        return {"epsilon": self.epsilon, "delta": self.delta, "target_epsilon": cfg.dp_epsilon, "accountant": "rdp",
                "mechanism": f"DP-SGD (Opacus, Poisson sampling) for training{others}; Gaussian mechanism on "
                             f"{curvature} and on the class counts",
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "steps": self.steps,
                **({"passes": [asdict(p) for p in self.passes]} if self.passes else {}),
                "clip": cfg.dp_clip, "curvature_clip": cfg.dp_curvature_clip, "release_noise": self.release_noise,
                **({"input_clip": cfg.dp_input_clip} if structure == "kron" else {}),
                "releases": self.releases, "training_share": cfg.dp_training_share, "opacus": opacus.__version__}


def _orders(coarse: bool) -> list[float]:
    """Opacus' RDP orders; ``coarse``: only the integer ones (thirty times cheaper for a subsampled mechanism, and
    an ε at least as large: calibrating on them and recording on all keeps the recorded ε within the target)."""
    from opacus.accountants.rdp import RDPAccountant

    return [a for a in RDPAccountant.DEFAULT_ALPHAS if not coarse or float(a).is_integer()]


def _epsilon(rdp, delta: float, coarse: bool = False) -> float:
    from opacus.accountants.analysis.rdp import get_privacy_spent

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order")  # a bound at the largest order is still valid
        return float(get_privacy_spent(orders=_orders(coarse), rdp=rdp, delta=delta)[0])


def _rdp(noise_multiplier: float, sample_rate: float, steps: int, coarse: bool = False):
    from opacus.accountants.analysis.rdp import compute_rdp

    return compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=_orders(coarse))


def _gradient_rdp(noise_multiplier: float, sample_rate: float, steps: int, passes: tuple[DPPass, ...],
                  coarse: bool):
    rdp = _rdp(noise_multiplier, sample_rate, steps, coarse)
    for p in passes:
        rdp = rdp + _rdp(noise_multiplier, p.sample_rate, p.steps, coarse)
    return rdp


def gradient_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                     passes: tuple[DPPass, ...] = (), coarse: bool = False) -> float:
    """ε at ``delta`` of every gradient pass: ``steps`` subsampled Gaussian steps at ``sample_rate`` and each of
    ``passes``, all at ``noise_multiplier`` (RDP, converted once; ``coarse``: on the integer orders)."""
    return _epsilon(_gradient_rdp(noise_multiplier, sample_rate, steps, passes, coarse), delta, coarse)


def composed_epsilon(noise_multiplier: float, sample_rate: float, steps: int, release_noise: float, releases: int,
                     delta: float, passes: tuple[DPPass, ...] = (), coarse: bool = False) -> float:
    """ε at ``delta`` of ``steps`` subsampled Gaussian steps, the other gradient ``passes`` at the same noise, plus
    ``releases`` full Gaussian releases (RDP; ``coarse``: on the integer orders, an upper bound of the full one)."""
    rdp = _gradient_rdp(noise_multiplier, sample_rate, steps, passes, coarse) + _rdp(release_noise, 1.0, releases,
                                                                                     coarse)
    return _epsilon(rdp, delta, coarse)


def release_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """ε at ``delta`` of ``releases`` full-batch Gaussian mechanisms of noise ``noise_multiplier`` × sensitivity
    (Opacus' RDP, converted once)."""
    return _epsilon(_rdp(noise_multiplier, 1.0, releases), delta)


def smallest_noise(epsilon_of: Callable[[float], float], epsilon: float, what: str) -> float:
    """The smallest noise multiplier σ in [1e-3, 1e4] with ``epsilon_of(σ) <= epsilon`` (ε falls as σ grows;
    bisection in log space); one ConfigError line naming ``what`` when none does."""
    lo, hi = 1e-3, 1e4
    if epsilon_of(hi) > epsilon:
        raise ConfigError(f"ε {epsilon:g} is out of reach for {what}")
    while hi / lo > 1 + 1e-6:  # about 25 evaluations
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if epsilon_of(mid) > epsilon else (lo, mid)
    return hi


def release_noise(epsilon: float, releases: int, delta: float) -> float:
    """The smallest noise multiplier whose ``releases`` Gaussian mechanisms compose to at most ``epsilon`` at
    ``delta`` (:func:`release_epsilon`); one ConfigError line when none in [1e-3, 1e4] does."""
    return smallest_noise(lambda s: release_epsilon(s, releases, delta), epsilon,
                          f"{releases} releases at δ {delta:g}")


def opacus_version() -> str:
    """Opacus' version; one ConfigError line naming the extra when it is not installed."""
    try:
        import opacus
    except ImportError:
        raise ConfigError("differential privacy needs Opacus, an optional install: pip install "
                          "'posterior-fusion[dp]'") from None
    return opacus.__version__


def plan(cfg: DPConfig, n: int, batch_size: int, epochs: int, components: int,
         passes: tuple[DPPass, ...] = ()) -> DPPlan:
    """Calibrate the noise for a silo of ``n`` samples (module docstring): the components' DP-SGD and the other
    gradient ``passes`` share one noise multiplier within ``dp_training_share`` of ε; one ConfigError line when no
    noise reaches the target."""
    cfg.validate()
    opacus_version()
    delta = cfg.dp_delta if cfg.dp_delta is not None else 1.0 / n
    q = min(1.0, batch_size / n)
    steps = max(1, components * epochs * math.ceil(n / batch_size))
    releases = components + 1
    try:  # calibrated on the integer orders (coarse): cheaper, and an ε at least the recorded one
        sigma = smallest_noise(lambda s: gradient_epsilon(s, q, steps, delta / 2, passes, coarse=True),
                               cfg.dp_training_share * cfg.dp_epsilon, "the training")
    except ConfigError:
        raise ConfigError(f"`dp_epsilon` {cfg.dp_epsilon:g}: no training noise reaches it") from None
    rest = (1 - cfg.dp_training_share) * cfg.dp_epsilon
    try:  # the smallest release noise within its share
        release = release_noise(rest, releases, delta / 2)
    except ConfigError:
        raise ConfigError(f"`dp_epsilon` {cfg.dp_epsilon:g} leaves too little for the curvature and count "
                          "releases") from None

    def within(scale: float, coarse: bool = True) -> bool:
        return composed_epsilon(sigma * scale, q, steps, release * scale, releases, delta, passes,
                                coarse=coarse) <= cfg.dp_epsilon

    while not within(1.0):  # RDP composition is tighter than the split in practice; make sure of it
        sigma, release = sigma * 1.02, release * 1.02
    # the split was calibrated part by part (each at δ/2); composed once, the same proportions need less noise:
    # the smallest common scale of both noises whose composed ε still meets the target
    lo, hi = 0.05, 1.0
    while hi - lo > 1e-6:  # about 20 evaluations
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if within(mid) else (mid, hi)
    lo = 0.9 * hi  # the integer orders' bound is a little loose: a few steps down on every order
    for _ in range(6):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if within(mid, coarse=False) else (mid, hi)
    sigma, release = sigma * hi, release * hi
    total = composed_epsilon(sigma, q, steps, release, releases, delta, passes)  # on every order: the record's
    return DPPlan(float(sigma), q, steps, float(release), releases, float(delta), total, tuple(passes))


def private_counts(counts: list[int], release_noise: float, generator: torch.Generator) -> list[int]:
    """The class histogram with Gaussian noise (sensitivity 1), rounded, floored at 0; at least one sample."""
    noisy = torch.tensor(counts, dtype=torch.float64) + release_noise * torch.randn(len(counts), generator=generator,
                                                                                  dtype=torch.float64)
    out = [int(v) for v in noisy.round().clamp_min(0)]
    if sum(out) == 0:
        out[int(torch.argmax(noisy))] = 1
    return out


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
    size = last.weight.numel() + (last.bias.numel() if last.bias is not None else 0)
    diag = torch.zeros(0, dtype=torch.float64)
    clipped = []
    feats: list[torch.Tensor] = []
    model.eval()
    handle = last.register_forward_hook(lambda m, i, o: feats.append(i[0].detach()))
    try:
        for i in range(0, len(x), batch_size):
            xb = x[i: i + batch_size]
            c = per_sample_ggn_diagonal(model, xb).double()[:, :-size]  # the diagonal part: all but the last layer
            feats.clear()
            with torch.no_grad():
                probs = model(xb).softmax(-1).double()
            phi_sq = feats[0].reshape(len(xb), -1).double().square().sum(1) + (last.bias is not None)  # ‖φ̃_n‖²
            H = torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]
            block_sq = torch.linalg.matrix_norm(H).square() * phi_sq.square()  # ‖H_n ⊗ φ̃_n φ̃_nᵀ‖_F²
            t = (curvature_clip / (c.square().sum(1) + block_sq).sqrt().clamp_min(1e-300)).clamp(max=1.0)
            part = (t[:, None] * c).sum(0).cpu()
            diag = part if i == 0 else diag + part
            clipped.append(t)
    finally:
        handle.remove()
    block = last_layer_ggn(model, x, batch_size, weights=torch.cat(clipped)).double()
    return diag, block


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
                if kfac == "reduce":
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
    ``train_cfg.epochs`` epochs of about n / batch steps; SGD with the configuration's learning rate and momentum;
    the decay toward ``prior_mean`` (zero by default) after each step. With ``soft_targets`` ``(n, classes)`` (a
    private teacher's probabilities on the silo, HBFL) each sample's loss is ``(1 − soft_weight) · CE(y) +
    soft_weight · CE(soft_targets)``: still one sample's term, clipped as a whole. Returns the SWAG moments of the
    private iterates when ``train_cfg.swag`` asks for them (post-processing: DP-SGD's guarantee covers every
    iterate), else None."""
    rate = plan_.sample_rate if sample_rate is None else sample_rate
    batch = max(1, round(rate * len(x)))
    gsm, opt = _opacus(model, torch.optim.SGD(model.parameters(), lr=train_cfg.lr, momentum=train_cfg.momentum),
                       plan_, dp.dp_clip, batch, noise)
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
