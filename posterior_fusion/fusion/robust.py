"""Screening of outlying clients before fusion (``fuse --robust``).

Rule, per client c, against the *other* clients (leave-one-out medians), needs C >= 3:

* curvature scale ``κ_c = log10( mean_m tr(G_cm) / n_c )`` (raw GGN per sample): outlier if
  ``|κ_c − median_{c'≠c} κ_c'| > log10(curvature_ratio)`` (default: more than 100x off);
* MAP distance ``δ_c = mean_m ‖ŵ_cm − median_{c'≠c} ŵ_c'm‖``: outlier if
  ``δ_c > distance_ratio · median_{c'≠c} δ_c'`` (default 3x), where every δ is measured
  against its own leave-one-out median.

Flagged clients are reported and excluded. This catches gross manipulation (curvature scaled
by orders of magnitude, MAPs far from everyone else); it is no defence against small,
carefully tuned perturbations (see docs/security.md).
"""

from __future__ import annotations

import math

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.errors import ConfigError, ScreeningError


def _median(values: list[float]) -> float:
    return float(torch.tensor(values, dtype=torch.float64).median())


def screen_clients(clients: list[ClientPosterior], curvature_ratio: float = 100.0,
                   distance_ratio: float = 3.0) -> tuple[list[ClientPosterior], list[dict]]:
    """Return ``(kept clients, report rows)``; each row says why a client was kept or excluded."""
    C = len(clients)
    if C < 3:
        raise ConfigError(f"--robust needs at least 3 clients to compare against each other, got {C}")
    if curvature_ratio <= 1 or distance_ratio <= 1:
        raise ConfigError("robust screening ratios must be > 1")
    M = min(c.num_components for c in clients)
    kappa = []
    for c in clients:
        traces = [float(comp.curvature.diagonal().double().sum()) for comp in c.components]
        kappa.append(math.log10(max(sum(traces) / len(traces) / c.n_data, 1e-300)))
    maps = torch.stack([torch.stack([c.components[m].map.double() for m in range(M)]) for c in clients])  # (C, M, d)

    def distance(c: int) -> float:
        others = torch.cat([maps[:c], maps[c + 1 :]])
        return float((maps[c] - others.median(dim=0).values).norm(dim=-1).mean())

    delta = [distance(c) for c in range(C)]
    rows, kept = [], []
    for c, client in enumerate(clients):
        k_ref = _median(kappa[:c] + kappa[c + 1 :])
        d_ref = _median(delta[:c] + delta[c + 1 :])
        reasons = []
        if abs(kappa[c] - k_ref) > math.log10(curvature_ratio):
            reasons.append(f"curvature per sample 10^{kappa[c]:.2f} vs others' median 10^{k_ref:.2f}")
        if delta[c] > distance_ratio * d_ref:
            reasons.append(f"MAP distance {delta[c]:.3g} > {distance_ratio:g} x others' median {d_ref:.3g}")
        rows.append({"file": client.path, "log10_curvature_per_sample": kappa[c], "map_distance": delta[c],
                     "excluded": bool(reasons), "reasons": reasons})
        if not reasons:
            kept.append(client)
    if not kept:
        raise ScreeningError("robust screening excluded every client; check the inputs or loosen the ratios")
    return kept, rows
