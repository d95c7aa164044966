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
"""

from __future__ import annotations

import math

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.curvature import Diag, Kron
from posterior_fusion.fusion.layer_solve import solve_kron_sum
from posterior_fusion.fusion.mode_laplace import component_log_densities
from posterior_fusion.progress import progress


class MixtureProduct:
    """The clients' mixtures for EM: per component its precision ``Λ_cm`` (float64) and MAP."""

    def __init__(self, clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                 server_prior_precision: float) -> None:
        self.clients, self.temperatures, self.prior_precisions = clients, temperatures, prior_precisions
        self.precisions = [[comp.curvature.astype(torch.float64).precision(t, lam) for comp in c.components]
                           for c, t, lam in zip(clients, temperatures, prior_precisions)]
        self.maps = [[comp.map.double() for comp in c.components] for c in clients]
        self.excess = math.fsum(prior_precisions) - float(server_prior_precision)  # over-counted prior
        self.lam0 = float(server_prior_precision)

    def responsibilities(self, w: torch.Tensor) -> tuple[list[torch.Tensor], float]:
        """``r_c`` ``(M_c,)`` per client at ``w`` ``(d,)`` and ``E(w)`` (up to the constant)."""
        logits = [row[0] for row in component_log_densities(self.clients, self.temperatures, self.prior_precisions,
                                                             w[None])]
        value = -0.5 * self.excess * float(w.square().sum()) - sum(float(torch.logsumexp(g, 0)) for g in logits)
        return [torch.softmax(g, 0) for g in logits], value

    def solve(self, rs: list[torch.Tensor], start: torch.Tensor, tolerance: float = 1e-10) -> torch.Tensor:
        """The bound's minimiser ``(d,)`` for responsibilities ``rs``, block by block."""
        terms = [(float(r), P, mu) for r_c, row, maps in zip(rs, self.precisions, self.maps)
                 for r, P, mu in zip(r_c, row, maps) if float(r) > 0]
        ref = terms[0][1]
        out = torch.empty_like(start)
        for j, off in enumerate(ref.offsets):
            blocks = [(r, P.blocks[j], mu[off: off + P.blocks[j].dim]) for r, P, mu in terms]
            dim = blocks[0][1].dim
            rhs = sum(r * b.matvec(m) for r, b, m in blocks)
            if all(isinstance(b, Kron) for _, b, _ in blocks):
                shape = blocks[0][1].shape
                w = torch.tensor([r * b.scale for r, b, _ in blocks], dtype=torch.float64)
                X, _, _ = solve_kron_sum([b.B.double() for _, b, _ in blocks], [b.A.double() for _, b, _ in blocks], w,
                                         rhs.reshape(shape), shift=self.lam0, start=start[off: off + dim].reshape(shape),
                                         tolerance=tolerance)
                out[off: off + dim] = X.reshape(-1)
            elif all(isinstance(b, Diag) for _, b, _ in blocks):
                out[off: off + dim] = rhs / (sum(r * b.diagonal() for r, b, _ in blocks) - self.excess)
            else:
                H = sum(r * b.to_dense().double() for r, b, _ in blocks)
                H = H - self.excess * torch.eye(dim, dtype=torch.float64)
                out[off: off + dim] = torch.cholesky_solve(rhs[:, None], torch.linalg.cholesky(H))[:, 0]
        return out


def em_modes(product: MixtureProduct, starts: torch.Tensor, iterations: int, tolerance: float = 1e-6,
             show_progress: bool = True) -> tuple[torch.Tensor, list[list[dict]]]:
    """EM from each row of ``starts`` ``(K, d)``: at most ``iterations`` solves per mode, stopping when
    an iteration moves ``w`` by less than ``tolerance`` relative to its norm. Returns the modes
    ``(K, d)`` (float32) and per mode its history ``[{step, objective, moved}]``."""
    modes, history = [], []
    for k in progress(range(len(starts)), "em modes", len(starts), show=show_progress):
        w = starts[k].double()
        rs, value = product.responsibilities(w)
        hist = [{"step": 0, "objective": value}]
        for step in range(1, iterations + 1):
            new = product.solve(rs, w)
            moved = float((new - w).norm()) / max(float(w.norm()), 1e-12)
            w = new
            rs, value = product.responsibilities(w)
            hist.append({"step": step, "objective": value, "moved": moved})
            if moved <= tolerance:
                break
        modes.append(w.float())
        history.append(hist)
    return torch.stack(modes), history
