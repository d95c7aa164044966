"""FedBEns' three ways to its modes: the paper's Adam on the global objective (best validation
iterate, else the best objective), EM to a stationary point, and EM under the evidence prior."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.fusion.em import MixtureProduct, em_modes
from posterior_fusion.fusion.methods.fedbens.evidence import evidence_server_prior
from posterior_fusion.fusion.methods.fedbens.fedbens_settings import FedBEnsSettings
from posterior_fusion.fusion.methods.fedbens.objective import GlobalLogPosterior
from posterior_fusion.fusion.optimise import optimise_modes
from posterior_fusion.fusion.types import FusionInputs


@dataclass
class Solved:
    """The modes ``(K, d)`` a solver reached, the record it adds to the artifact (``history``, …), the server
    prior it ended with (one λ0, or one per curvature block under the evidence) and, where it already formed
    them, the modes' Laplace precisions (else None)."""

    modes: torch.Tensor
    info: dict
    server_prior: float | list[float]
    laplace_step: tuple | None = None


def solve_modes(inputs: FusionInputs, settings: FedBEnsSettings, clients: list[ClientPosterior], temps: list[float],
                lams: list[float], lam0: float, W0: torch.Tensor, centres: torch.Tensor | None) -> Solved:
    """Run the solver ``settings`` resolved to from the starts ``W0`` ``(K, d)``."""
    if settings.server_prior == "evidence":  # lam0 becomes one λ0 per curvature block
        found = evidence_server_prior(clients, temps, lams, lam0, W0, centres, settings, inputs.options.progress)
        return Solved(found.modes, {"history": found.history, "server_prior_search": found.record},
                      found.prior_blocks, found.laplace_step)
    if settings.solver == "em":  # per-layer solves on the clients' own blocks: no stacked copy of them
        best, history = em_modes(MixtureProduct(clients, temps, lams, lam0), W0, settings.steps,
                                 show_progress=inputs.options.progress, trust_radius=settings.trust_radius,
                                 prior_centres=centres)
        return Solved(best, {"history": history}, lam0)
    objective = GlobalLogPosterior(clients, temps, lams, lam0, spectral_cutoff=settings.spectral_cutoff,
                                   kernel=inputs.options.kernel, device=inputs.options.device,
                                   show_progress=inputs.options.progress, prior_centres=centres)
    best, history = optimise_modes(objective, W0, inputs, settings, "fedbens")
    return Solved(best, {"history": history, "kron_ranks": objective.stack.ranks}, lam0)
