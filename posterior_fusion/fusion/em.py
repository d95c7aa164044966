"""The modes of fedbens' global posterior by EM (minorise-maximise) with exact per-layer solves.

For the negative log posterior ``E(w) = −Σ_c log Σ_m π_cm N(w; ŵ_cm, Λ_cm⁻¹) − ½ (Σ_c λ_c − λ0) ‖w‖²``
(``Λ_cm = G_cm / T_c + λ_c I``), Jensen's inequality at the current ``w_t`` with responsibilities
``r_cm ∝ π_cm N(w_t; ŵ_cm, Λ_cm⁻¹)`` (a softmax over each client's components) bounds ``E`` from
above by a quadratic that touches it at ``w_t``; its minimiser solves

    (Σ_cm r_cm Λ_cm − (Σ_c λ_c − λ0) I) w = Σ_cm r_cm Λ_cm ŵ_cm ,

an SPD system (its matrix is ``Σ_cm r_cm G_cm / T_c + λ0 I``) that is block-diagonal like the
curvature: a Kronecker weight by conjugate gradients (``fusion/layer_solve.py``), a dense block by a
Cholesky solve, a diagonal one element-wise. Each iteration lowers ``E``; the iterates stop at a
stationary point (where ``r`` no longer changes the solution), whatever the validation data — no
step size, no early stopping. ``starts`` are the same as Adam's.

**Trust region** (``trust_radius`` ρ > 0): each mode stays in the ellipsoid

    ½ (w − s)ᵀ Λ̄ (w − s) / N ≤ ρ ,   Λ̄ = Σ_cm r⁰_cm Λ_cm ,   N = Σ_c n_c ,

around its start s, in the clients' own metric (r⁰: the responsibilities at s): the clients'
quadratic models predict that no point of it raises their summed tempered loss by more than ρ
nats per sample. Each EM step minimises the bound inside the region: if the bound's minimiser lies
outside, the step solves ``(Σ r Λ + ν Λ̄ − (Σλ − λ0) I) w = Σ r Λ ŵ + ν Λ̄ s`` with the multiplier
ν ≥ 0 found by bisection so that the boundary is met from inside (the same block solves, with the
client terms reweighted). The start is inside, so each step still lowers the objective; where the
unconstrained iterate never leaves the region, the result is the plain EM's. (The boundary point
is found to a relative 1e-4 of the radius; a step that would raise the objective by that slack
ends the iterations instead.)

**A server prior per block** (fedbens' ``server_prior = "evidence"``): ``λ0`` may be one number per
curvature block; each block's system then has its own ``λ0_j`` and excess ``Σ_c λ_c − λ0_j``.

**Prior centre** (fedbens' ``prior_centre = "clients"``): with the over-counted prior divided out at
μ instead of zero (``−½ (Σ λ_c − λ0) ‖w − μ‖²``), the system's right-hand side gains
``− (Σ_c λ_c − λ0) μ``; its matrix is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.fusion.layer_solve import solve_precision_sum
from posterior_fusion.fusion.mode_laplace import component_log_densities, per_block, per_coordinate, quadratic_form64
from posterior_fusion.progress import progress


class MixtureProduct:
    """The clients' mixtures for EM: per component its precision ``Λ_cm`` and MAP, in the artifacts' dtype
    (each block is converted to float64 where it is used, one block at a time: no float64 copy of every
    client's curvature, nor of one layer's, is held)."""

    def __init__(self, clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                 server_prior_precision: float | Sequence[float]) -> None:
        self.clients, self.temperatures, self.prior_precisions = clients, temperatures, prior_precisions
        self.precisions = [[comp.curvature.precision(t, lam) for comp in c.components]
                           for c, t, lam in zip(clients, temperatures, prior_precisions)]
        self.maps = [[comp.map for comp in c.components] for c in clients]
        ref = clients[0].components[0].curvature
        lam0 = per_block(server_prior_precision, len(ref.blocks))  # one server λ0 per block
        # the over-counted prior per block, and per coordinate (d,) for the objective's value
        self.excess = [math.fsum(prior_precisions) - float(v) for v in lam0]
        self._excess_d = per_coordinate(self.excess, [b.dim for b in ref.blocks])
        self.n_total = float(sum(c.n_data for c in clients))

    def responsibilities(self, w: torch.Tensor, centre: torch.Tensor | None = None) -> tuple[list[torch.Tensor], float]:
        """``r_c`` ``(M_c,)`` per client at ``w`` ``(d,)`` and ``E(w)`` (up to the constant), the
        over-counted prior divided out at ``centre`` ``(d,)`` (default zero)."""
        logits = [row[0] for row in component_log_densities(self.clients, self.temperatures, self.prior_precisions,
                                                             w[None])]
        off = (w if centre is None else w - centre).double()
        value = (-0.5 * float((self._excess_d * off.square()).sum())
                 - sum(float(torch.logsumexp(g, 0)) for g in logits))
        return [torch.softmax(g, 0) for g in logits], value

    def metric(self, rs: list[torch.Tensor], v: torch.Tensor) -> float:
        """``½ vᵀ (Σ_cm r_cm Λ_cm) v / N`` for ``v`` ``(d,)``: per-sample nats in the clients' metric."""
        total = sum(float(r) * float(quadratic_form64(P, v)) for r_c, row in zip(rs, self.precisions)
                    for r, P in zip(r_c, row) if float(r) > 0)
        return 0.5 * total / self.n_total

    def solve(self, rs: list[torch.Tensor], start: torch.Tensor, tolerance: float = 1e-10,
              pull: tuple[float, list[torch.Tensor], torch.Tensor] | None = None,
              centre: torch.Tensor | None = None) -> torch.Tensor:
        """The bound's minimiser ``(d,)`` for responsibilities ``rs``, block by block; ``pull`` =
        ``(ν, r⁰, s)`` adds the trust region's term ``ν/2 (w − s)ᵀ (Σ r⁰ Λ) (w − s)``; ``centre``
        ``(d,)``: the over-counted prior divided out there (default zero)."""
        terms = [(float(r), P, mu) for r_c, row, maps in zip(rs, self.precisions, self.maps)
                 for r, P, mu in zip(r_c, row, maps) if float(r) > 0]
        if pull is not None and pull[0] > 0:
            nu, r0, pull_start = pull
            terms += [(nu * float(r), P, pull_start) for r_c, row in zip(r0, self.precisions) for r, P in zip(r_c, row)
                      if float(r) > 0]
        # the matrix is Σ r Λ − excess·I (λ0 I when Σ_m r_cm = 1, no pull); the centre moves the right-hand side
        rhs = None if centre is None else -self._excess_d * centre.double()
        # Σ r Λ − excess·I = Σ r G + λ0 I is positive definite: a direction without curvature is an error (strict)
        out, _ = solve_precision_sum(terms, shift=[-e for e in self.excess], rhs=rhs, start=start, tolerance=tolerance,
                                     strict=True)
        return out


def trust_region_solve(product: MixtureProduct, rs: list[torch.Tensor], w: torch.Tensor, start: torch.Tensor,
                       r0: list[torch.Tensor], radius: float, nu: float = 1.0, rel_tol: float = 1e-4,
                       max_evals: int = 60, centre: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """The bound's minimiser inside the trust region (module docstring) and its multiplier ν.

    The distance to ``start`` falls as ν grows; ν is bracketed by factors of 4 from ``nu`` (the
    previous step's) and bisected in log space until the distance is within ``rel_tol`` of the
    radius. The returned point is always the feasible end of the bracket."""
    free = product.solve(rs, w, centre=centre)
    if product.metric(r0, free - start) <= radius:
        return free, 0.0

    def at(v: float) -> tuple[torch.Tensor, float]:
        x = product.solve(rs, w, pull=(v, r0, start), centre=centre)
        return x, product.metric(r0, x - start)

    lo, hi, evals = 0.0, max(nu, 1e-12), 0
    x_hi, d_hi = at(hi)
    while d_hi > radius and evals < max_evals:  # grow until feasible
        lo, hi = hi, hi * 4
        x_hi, d_hi = at(hi)
        evals += 1
    if lo == 0.0:  # shrink while still feasible, to bracket from below
        while evals < max_evals:
            x, dist = at(hi / 4)
            evals += 1
            if dist > radius:
                lo = hi / 4
                break
            hi, x_hi, d_hi = hi / 4, x, dist
    if d_hi > radius:  # never reached in practice (ν = 4^max_evals pins w to the start)
        return start.clone(), hi
    while evals < max_evals and lo > 0 and d_hi < radius * (1 - rel_tol):
        mid = math.sqrt(lo * hi)
        x, dist = at(mid)
        evals += 1
        if dist > radius:
            lo = mid
        else:
            hi, x_hi, d_hi = mid, x, dist
    return x_hi, hi


def em_modes(product: MixtureProduct, starts: torch.Tensor, iterations: int, tolerance: float = 1e-6,
             show_progress: bool = True, trust_radius: float = 0.0,
             prior_centres: torch.Tensor | None = None) -> tuple[torch.Tensor, list[list[dict]]]:
    """EM from each row of ``starts`` ``(K, d)``: at most ``iterations`` solves per mode, stopping when
    an iteration moves ``w`` by less than ``tolerance`` relative to its norm; ``trust_radius`` > 0
    keeps each mode in its trust region; ``prior_centres`` ``(K, d)``: row k's over-counted prior is
    divided out at its row (module docstring). Returns the modes ``(K, d)`` (float32)
    and per mode its history ``[{step, objective, moved}]`` (with the trust region also
    ``distance``, in per-sample nats, and the multiplier ``nu``)."""
    modes, history = [], []
    for k in progress(range(len(starts)), "em modes", len(starts), show=show_progress):
        s = starts[k].double()
        centre = None if prior_centres is None else prior_centres[k].double()
        w = s.clone()
        rs, value = product.responsibilities(w, centre)
        r0, nu = rs, 1.0
        hist = [{"step": 0, "objective": value}]
        for step in range(1, iterations + 1):
            if trust_radius > 0:
                new, nu_used = trust_region_solve(product, rs, w, s, r0, trust_radius, nu, centre=centre)
                nu = nu_used or nu
            else:
                new = product.solve(rs, w, centre=centre)
            moved = float((new - w).norm()) / max(float(w.norm()), 1e-12)
            new_rs, new_value = product.responsibilities(new, centre)
            if trust_radius > 0 and new_value > value:  # the bisection's boundary point is approximate: at
                break                                    # the boundary it can lose what the step gained
            w, rs, value = new, new_rs, new_value
            hist.append({"step": step, "objective": value, "moved": moved})
            if trust_radius > 0:
                hist[-1].update(distance=product.metric(r0, w - s), nu=nu_used)
            if moved <= tolerance:
                break
        modes.append(w.float())
        history.append(hist)
    return torch.stack(modes), history
