"""The server prior's strength from the evidence (``server_prior = "evidence"``): one precision per
curvature block, ``λ0_j = ρ c_j``, with ρ where the modes' Laplace evidence is stationary — MacKay's
empirical Bayes with the clients' likelihoods held fixed, no data needed."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from posterior_fusion import ranges
from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.fusion.em import MixtureProduct, em_modes
from posterior_fusion.fusion.methods.fedbens.fedbens_settings import FedBEnsSettings
from posterior_fusion.fusion.mode_laplace import EVIDENCE_RANGE, evidence_prior_precision, mode_precisions
from posterior_fusion.progress import progress


@dataclass(frozen=True)
class EvidenceSearch:
    """What :func:`evidence_server_prior` found: ``prior_blocks`` (λ0 per curvature block), the ``modes``
    ``(K, d)`` EM reached at them with their EM ``history``, the ``record`` written to the artifact
    (``block_scales``, ``rounds: [{scale, next, em_steps}]``, ``converged``, ``at_bound``) and the last
    round's :func:`~posterior_fusion.fusion.mode_laplace.mode_precisions` at the modes, or None (the Laplace
    step at the modes reuses it: it does not depend on λ0)."""

    prior_blocks: list[float]
    modes: torch.Tensor
    history: list
    record: dict
    laplace_step: tuple | None


EVIDENCE_ROUNDS = 30       # server_prior=evidence: at most this many EM solves


EVIDENCE_TOLERANCE = 0.01  # … stopping when λ0 moves by less than this, relative


CLIMB_ROUNDS = 4          # … rounds in a row in which ρ rose by at least CLIMB_FACTOR: no interior maximum
CLIMB_FACTOR = 1.2
RESOLUTION = 1e-6          # … keeping each λ0_j ≥ this × block j's largest curvature (float32 resolves ≈ 1e-8 of it)


def per_block_client_sum(clients: list[ClientPosterior], temps: list[float], value) -> list[float]:
    """Per curvature block j, ``Σ_c mean_m value(G_cm,j) / T_c`` (``value``: a block -> a float)."""
    blocks = len(clients[0].components[0].curvature.blocks)
    return [math.fsum(sum(value(comp.curvature.blocks[j]) for comp in c.components) / (c.num_components * t)
                      for c, t in zip(clients, temps)) for j in range(blocks)]


def curvature_scales(clients: list[ClientPosterior], temps: list[float]) -> list[float]:
    """Per curvature block j, ``c_j``: the mean diagonal entry of the clients' summed tempered curvature
    ``Σ_c mean_m G_cm / T_c`` over the block (how much curvature the block has per parameter)."""
    return per_block_client_sum(clients, temps, lambda block: float(block.diagonal().double().mean()))


def curvature_tops(clients: list[ClientPosterior], temps: list[float]) -> list[float]:
    """Per curvature block j, ``Σ_c mean_m λ_max(G_cm) / T_c``: an upper bound of the largest eigenvalue of the
    clients' summed tempered curvature (float64, from each block's clamped, cached spectrum)."""
    def top(block) -> float:
        values, other = block.spectrum()
        return float(values.max()) * (float(other.max()) if other is not None else 1.0)

    return per_block_client_sum(clients, temps, top)


def server_prior_blocks(scales: list[float], rho: float, lam0: float) -> list[float]:
    """The server prior's precision per curvature block at scale ρ: ``λ0_j = ρ c_j`` (``scales``: the blocks'
    ``c_j``, :func:`curvature_scales`); a block without curvature (``c_j ≤ 0``) keeps the clients' ``lam0``. Each
    λ0_j is clamped into the artifacts' prior-precision range: ρ at the end of its range is the range's bound over
    the largest c_j, and the product can round one ulp past it (1e8 · (1 + 2⁻⁵²), which the reader refuses)."""
    lo, hi = ranges.PRIOR_PRECISION
    return [min(max(rho * c, lo), hi) if c > 0 else lam0 for c in scales]


def evidence_server_prior(clients: list[ClientPosterior], temps: list[float], lams: list[float], lam0: float,
                          W0: torch.Tensor, centres: torch.Tensor | None, settings: FedBEnsSettings,
                          show_progress: bool = True) -> EvidenceSearch:
    """``server_prior=evidence``: one server prior precision per curvature block, ``λ0_j = ρ c_j`` with
    ``c_j`` the block's curvature per parameter (:func:`curvature_scales`; a block without curvature keeps
    the clients' λ0), and the scale ρ at which the modes' Laplace evidence is stationary, the modes EM's
    stationary points at those λ0_j (an :class:`EvidenceSearch`).

    The clients' likelihoods ``q_c / p0_c`` do not depend on the server's prior, so
    ``Z(ρ) = ∫ Π_c (q_c / p0_c)(w) N(w; μ, diag(λ0_j I)⁻¹) dw`` is a marginal likelihood in ρ; at stationary
    modes the derivative of its Laplace approximation is ``½ (γ/ρ − Σ_j c_j ‖w*_j − μ_j‖²)`` with
    ``γ = Σ_i h_i / (h_i + λ0_j)`` over the curvature at the modes (MacKay). Each round solves EM from the
    last round's modes, then moves ρ to the maximiser with those modes held fixed
    (:func:`~posterior_fusion.fusion.mode_laplace.evidence_prior_precision` on ``w* − μ`` with the block
    scales), until ρ moves by less than :data:`EVIDENCE_TOLERANCE` (at most :data:`EVIDENCE_ROUNDS` rounds;
    then the last round's are kept and the record says so). The first ρ puts the parameter-weighted mean
    λ0_j at the clients' λ0."""
    scales = [max(c, 0.0) for c in curvature_scales(clients, temps)]
    dims = [b.dim for b in clients[0].components[0].curvature.blocks]
    seen = [c > 0 for c in scales]
    seen_dims = sum(n for n, ok in zip(dims, seen) if ok)
    weighted = math.fsum(c * n for c, n in zip(scales, dims)) / max(seen_dims, 1)  # mean c_j over seen parameters
    # every λ0_j stays in the artifacts' prior-precision range (the evidence may have no interior maximum) and
    # above what the float32 curvature resolves (RESOLUTION × the block's largest curvature: below that a
    # summed precision may be indefinite in its rounding; ≤ RESOLUTION × the block's size in ρ, so ≤ 0.04 on
    # the LeNet and ResNet-20 width-16 blocks, whose evidence gave ρ = 0.07–0.14)
    floor = max((RESOLUTION * t / c for t, c in zip(curvature_tops(clients, temps), scales) if c > 0), default=0.0)
    lo = max(ranges.PRIOR_PRECISION[0] / min((c for c in scales if c > 0), default=1.0), EVIDENCE_RANGE[0], floor)
    hi = min(ranges.PRIOR_PRECISION[1] / max(scales, default=1.0), EVIDENCE_RANGE[1])
    rho = min(max(lam0 / weighted if weighted > 0 else 1.0, lo), hi)

    W, rounds, history, converged, laplace_step = W0, [], [], False, None
    for i in progress(range(EVIDENCE_ROUNDS), "server prior (evidence)", EVIDENCE_ROUNDS, show=show_progress):
        lams0 = server_prior_blocks(scales, rho, lam0)
        W, history = em_modes(MixtureProduct(clients, temps, lams, lams0), W, settings.steps, show_progress=False,
                              trust_radius=settings.trust_radius, prior_centres=centres)
        if not any(seen):
            converged = True
            break
        laplace_step = mode_precisions(clients, temps, lams, lam0, W, show_progress=False)
        offsets = W if centres is None else W - centres
        nxt, _ = evidence_prior_precision(list(offsets), laplace_step[0], block_scales=scales)
        nxt = min(max(nxt, lo), hi)
        rounds.append({"scale": rho, "next": nxt, "em_steps": [len(h) - 1 for h in history]})
        if abs(math.log(nxt / rho)) < EVIDENCE_TOLERANCE:
            converged = True
            break
        climbing = len(rounds) >= CLIMB_ROUNDS and all(r["next"] >= CLIMB_FACTOR * r["scale"]
                                                       for r in rounds[-CLIMB_ROUNDS:])
        if climbing and nxt < hi:  # the evidence keeps rising with ρ: solve once at the bound and check it there
            nxt = hi
        if i + 1 < EVIDENCE_ROUNDS:  # else the last modes are kept with the ρ they were solved at
            rho, laplace_step = nxt, None  # the modes will move: their curvature with them
    upper, lower = rho >= hi * (1 - 1e-6), rho <= lo * (1 + 1e-6)
    no_maximum = converged and (upper or lower)
    if not converged:
        warnings.warn(f"fedbens server_prior=evidence: ρ still moved after {EVIDENCE_ROUNDS} rounds (last "
                      f"{rounds[-1]['scale']:.3g} -> {rounds[-1]['next']:.3g}); the last round's modes are kept",
                      stacklevel=3)
    elif upper:
        warnings.warn(f"fedbens server_prior=evidence: the evidence has no interior maximum — it keeps rising as the "
                      f"prior strengthens, to the upper bound of its range (ρ = {rho:.3g}): the clients agree "
                      "within their posterior widths, and the modes are their λ-weighted average (the prior centre)",
                      stacklevel=3)
    elif lower:
        warnings.warn(f"fedbens server_prior=evidence: the evidence has no interior maximum — it keeps rising as the "
                      f"prior weakens, to the lower bound of its range (ρ = {rho:.3g}: as weak as the curvature's float32 resolution or the "
                      "artifacts' range allows): the clients disagree more than their curvature explains; a client "
                      "whose curvature is far out of scale with the others' does this (see --robust)", stacklevel=3)
    return EvidenceSearch(server_prior_blocks(scales, rho, lam0), W, history,
                          {"block_scales": scales, "rounds": rounds, "converged": converged,
                           "at_bound": upper or lower, "no_interior_maximum": no_maximum}, laplace_step)
