"""Screening of outlying clients before fusion (``fuse --robust``), a stated rule for C >= 3.

Every statistic is compared with the **median over all C clients** (one attacker among three
cannot move a median of three), and is computed on what fusion actually uses: the curvature
divided by the temperature fusion will apply (the server's override, else the client's T),
the prior precision fusion will apply, and the MAPs. A client c is excluded when

1. **curvature scale** ``κ_c = log10( mean_m mean(diag G_cm) / (T_c · n_c) )`` (effective
   curvature per claimed sample) is off the median by more than ``curvature_ratio`` (5x):
   catches scaled curvature, a tiny claimed T and a huge claimed ``n_data``;
2. **prior precision** ``log10 λ0_c`` is off the median by more than ``prior_ratio`` (100x);
3. **MAP distance** ``δ_c = mean_m ‖ŵ_cm − med_c' ŵ_c'm‖`` (coordinate-wise median) exceeds
   ``distance_ratio`` (2x) times the median δ: catches random or sign-flipped MAPs;
4. **duplicate**: its MAPs equal an earlier client's to relative ``duplicate_tol`` (1e-3):
   a resubmission with a changed byte or metadata (content, not hashes, is compared);
5. **validation** (only with server validation data): its first component's accuracy is
   below both half the median client accuracy and chance (1/K): catches label flips.

Measured on honest Fashion-MNIST clients at α = 0.1 (5 clients, 20 epochs): κ within 2.1x
of the median (≤ 0.32 in log10), δ within 1.2x; a sign flip gives ≈ 3x. What it cannot
catch: a client that scales its curvature *and* its claimed n_data consistently (more data
than it has), small perturbations under the ratios, or a coalition of half the clients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError, ScreeningError
from posterior_fusion.models.functional import batched_logits


@dataclass(frozen=True)
class ScreeningRule:
    curvature_ratio: float = 5.0
    prior_ratio: float = 100.0
    distance_ratio: float = 2.0
    duplicate_tol: float = 1e-3

    def validate(self) -> None:
        if min(self.curvature_ratio, self.prior_ratio, self.distance_ratio) <= 1 or not 0 < self.duplicate_tol < 1:
            raise ConfigError("robust screening ratios must be > 1 and the duplicate tolerance in (0, 1)")


def _median(values: list[float]) -> float:
    """The median of the values (mean of the two middle ones for an even count)."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def screen_clients(clients: list[ClientPosterior], rule: ScreeningRule | None = None,
                   temperature: Callable[[ClientPosterior], float] | None = None,
                   prior_precision: Callable[[ClientPosterior], float] | None = None,
                   val: SiloData | None = None) -> tuple[list[ClientPosterior], list[dict]]:
    """Return ``(kept clients, report rows)``; each row says why a client was kept or excluded.

    ``temperature`` / ``prior_precision``: what fusion will use per client (default: the
    client's own values).
    """
    rule = rule or ScreeningRule()
    rule.validate()
    C = len(clients)
    if C < 3:
        raise ConfigError(f"`robust` needs at least 3 clients to compare against each other, got {C}")
    temperature = temperature or (lambda c: c.temperature)
    prior_precision = prior_precision or (lambda c: c.prior_precision)
    M = min(c.num_components for c in clients)
    maps = torch.stack([torch.stack([c.components[m].map.double() for m in range(M)]) for c in clients])  # (C, M, d)
    duplicate_of: dict[int, int] = {}
    for i in range(C):  # content, not hashes: a resubmission with one byte or field changed
        for j in range(i):
            if j not in duplicate_of and float((maps[i] - maps[j]).norm() / maps[j].norm().clamp_min(1e-30)) < rule.duplicate_tol:
                duplicate_of[i] = j
                break
    unique = [i for i in range(C) if i not in duplicate_of]  # the statistics' reference set
    kappa, log_lam = [], []
    for c in clients:
        mean_diag = sum(float(comp.curvature.diagonal().double().mean()) for comp in c.components) / c.num_components
        kappa.append(math.log10(max(mean_diag / (temperature(c) * c.n_data), 1e-300)))
        log_lam.append(math.log10(prior_precision(c)))
    center = maps[unique].median(dim=0).values
    delta = (maps - center).norm(dim=-1).mean(-1).tolist()
    k_ref, l_ref = _median([kappa[i] for i in unique]), _median([log_lam[i] for i in unique])
    d_ref = max(_median([delta[i] for i in unique]), 1e-12)
    accuracy = None
    if val is not None:
        x, y = val.tensors()
        logits = batched_logits(clients[0].model_spec, maps[:, 0].float(), x)
        accuracy = (logits.argmax(-1) == y).double().mean(-1).tolist()
        a_ref, chance = _median([accuracy[i] for i in unique]), 1.0 / clients[0].model_spec.num_classes
    rows, kept = [], []
    for i, client in enumerate(clients):
        reasons = []
        if abs(kappa[i] - k_ref) > math.log10(rule.curvature_ratio):
            reasons.append(f"curvature per sample 10^{kappa[i]:.2f} vs the median 10^{k_ref:.2f}")
        if abs(log_lam[i] - l_ref) > math.log10(rule.prior_ratio):
            reasons.append(f"prior precision 10^{log_lam[i]:.2f} vs the median 10^{l_ref:.2f}")
        if delta[i] > rule.distance_ratio * d_ref:
            reasons.append(f"MAP distance {delta[i]:.3g} > {rule.distance_ratio:g} x the median {d_ref:.3g}")
        if i in duplicate_of:
            reasons.append(f"duplicate of {clients[duplicate_of[i]].path} (MAPs equal to {rule.duplicate_tol:g})")
        if accuracy is not None and accuracy[i] < min(0.5 * a_ref, chance):
            reasons.append(f"validation accuracy {accuracy[i]:.3f} below chance and half the median {a_ref:.3f}")
        row = {"file": client.path, "log10_curvature_per_sample": kappa[i], "log10_prior_precision": log_lam[i],
               "map_distance": delta[i], "excluded": bool(reasons), "reasons": reasons}
        if accuracy is not None:
            row["val_accuracy"] = accuracy[i]
        rows.append(row)
        if not reasons:
            kept.append(client)
    if len(kept) < (C + 1) // 2:
        raise ScreeningError(f"robust screening would exclude {C - len(kept)} of {C} clients; the rule assumes an "
                             "honest majority, so nothing is fused (check the inputs)")
    return kept, rows
