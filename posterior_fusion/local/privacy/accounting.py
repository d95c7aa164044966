"""The privacy accountant of a private client artifact (:mod:`posterior_fusion.local.privacy`): the mechanisms'
noise calibrated to the (ε, δ) asked for, composed by Opacus' Rényi-DP accountant, and the class-count release."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from posterior_fusion.artifact.privacy import epsilon_of, rdp
from posterior_fusion.errors import ConfigError
from posterior_fusion.local.fit_config import DPConfig


@dataclass(frozen=True)
class DPPass:
    """One more pass of subsampled Gaussian steps over the silo at the plan's ``noise_multiplier``: FedPPD's SGLD
    chain and its student's distillation, or HBFL's local model (``part`` names it)."""

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
    passes: tuple[DPPass, ...] = ()  # the other gradient passes (FedPPD, a local model), at noise_multiplier

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


def _gradient_rdp(noise_multiplier: float, sample_rate: float, steps: int, passes: tuple[DPPass, ...],
                  coarse: bool):
    values = rdp(noise_multiplier, sample_rate, steps, coarse)
    for p in passes:
        values = values + rdp(noise_multiplier, p.sample_rate, p.steps, coarse)
    return values


def gradient_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                     passes: tuple[DPPass, ...] = (), coarse: bool = False) -> float:
    """ε at ``delta`` of every gradient pass: ``steps`` subsampled Gaussian steps at ``sample_rate`` and each of
    ``passes``, all at ``noise_multiplier`` (RDP, converted once; ``coarse``: on the integer orders)."""
    return epsilon_of(_gradient_rdp(noise_multiplier, sample_rate, steps, passes, coarse), delta, coarse)


def composed_epsilon(noise_multiplier: float, sample_rate: float, steps: int, release_noise: float, releases: int,
                     delta: float, passes: tuple[DPPass, ...] = (), coarse: bool = False) -> float:
    """ε at ``delta`` of ``steps`` subsampled Gaussian steps, the other gradient ``passes`` at the same noise, plus
    ``releases`` full Gaussian releases (RDP; ``coarse``: on the integer orders, an upper bound of the full one)."""
    values = _gradient_rdp(noise_multiplier, sample_rate, steps, passes, coarse) + rdp(release_noise, 1.0, releases,
                                                                                     coarse)
    return epsilon_of(values, delta, coarse)


def release_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """ε at ``delta`` of ``releases`` full-batch Gaussian mechanisms of noise ``noise_multiplier`` × sensitivity
    (Opacus' RDP, converted once)."""
    return epsilon_of(rdp(noise_multiplier, 1.0, releases), delta)


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
