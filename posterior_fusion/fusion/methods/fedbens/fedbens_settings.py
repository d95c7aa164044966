"""FedBEns' settings record, and the rule that resolves its ``auto`` values into what runs."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from posterior_fusion import ranges
from posterior_fusion.choices import Choice
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.optimise import OptimiserSettings
from posterior_fusion.fusion.settings_parsing import setting


class Starts(Choice):
    """Where the global modes start."""

    MEDIAN = "median", "per component index, the clients' coordinate-wise median (the paper)"
    CLIENTS = "clients", "every client component's MAP: C·M modes"
    MEDIAN_CLIENTS = "median+clients", "both"


class Solver(Choice):
    """FedBEns' optimiser."""

    AUTO = "auto", ("em with the validation-free prior (prior_centre and server_prior 'auto' become 'clients' and "
                    "'evidence') when the server has no validation data (--val) and the curvature is kron, or when "
                    "server_prior=evidence or trust_radius asks for EM; else adam (diag and diag+full: Adam's early "
                    "iterates predict better there)")
    ADAM = "adam", ("the paper's Adam, best validation iterate (else the best objective, which under strong "
                    "heterogeneity predicts far worse)")
    EM = "em", ("EM with exact per-layer solves to a stationary point (steps = iterations at most; no step size, no "
                "early stopping, no use of validation data)")


class PriorCentre(Choice):
    """Where the over-counted prior is divided out."""

    AUTO = "auto", "clients when solver=auto runs EM, else prior"
    PRIOR = "prior", ("where the clients' prior is centred: zero from random starting points, the paper's "
                      "N(0, λ⁻¹) C − 1 times, which multiplies the weights by C along directions no client's "
                      "curvature sees; the base when the clients fine-tuned one (the exact product)")
    CLIENTS = "clients", ("at each mode's λ-weighted client average of the MAPs of its component index: those "
                          "directions keep the clients' average")


class LaplacePrior(Choice):
    """Prior precision of the Laplace approximation at the modes."""

    SERVER = "server", "λ0 = 1/prior_var, the objective's"
    EVIDENCE = "evidence", ("the δ maximising the modes' Laplace evidence with the modes held fixed (MacKay's "
                            "empirical Bayes: no data needed; recorded in the artifact)")


class ServerPrior(Choice):
    """The server prior's precision."""

    AUTO = "auto", "evidence when solver=auto runs EM, else clients"
    CLIENTS = "clients", "one λ0, the median of the clients' or 1/--prior-var"
    EVIDENCE = "evidence", ("solver=em only: one λ0 per curvature block, ρ × the block's curvature per parameter, ρ "
                            "maximising the Laplace evidence of the server's model with the clients' likelihoods "
                            "held fixed (MacKay's empirical Bayes, no data needed; EM re-solved until ρ moves by "
                            "< 1 %; recorded in the artifact)")


class ModeWeights(Choice):
    """Mixture weights of the global modes."""

    EQUAL = "equal", "1/K each"
    LAPLACE = "laplace", "∝ p(w*|D) |Λ*|^-1/2"


STARTS = Starts.values()


@dataclass(frozen=True)
class FedBEnsSettings(OptimiserSettings):
    """FedBEns: Adam settings plus the number of global modes and the low-rank shortcut."""

    modes: int | None = setting(None, "Number of global modes; None = the clients' M.", bounds=ranges.COMPONENTS)
    laplace: bool = setting(True, "Store a Laplace approximation of the global posterior at each mode "
                                  "(enables evaluate --predictive mc|glm).")
    laplace_prior: str = setting("server", "Prior precision of the Laplace approximation at the modes (what mc/glm "
                                           "predict with).", choices=LaplacePrior)
    mode_weights: str = setting("equal", "Mixture weights of the modes.", choices=ModeWeights)
    allow_different_inits: bool = setting(False, "Fuse clients whose starting points differ (their m-th components "
                                                 "then need not be near each other; the per-mode median start is then meaningless).")
    spectral_cutoff: float = setting(0.0, "solver=adam on kron: drop the eigen-directions of each Kronecker block with curvature < spectral_cutoff·λ0 "
                                      "(relative objective error < tol); 0 = exact.", bounds=(0, 0.999999))
    starts: str = setting("median", "Where the global modes start.", choices=Starts)
    solver: str = setting("auto", "The optimiser of the global modes.", choices=Solver)
    damping: float = setting(0.0, "Tikhonov damping d of every client's curvature at per-sample scale: a Kronecker "
                                  "block (B + n·d·I) ⊗ (A + d·I), any other block + n·d on its diagonal (K-FAC's "
                                  "factored damping; FedLPA's d = 0.0316); 0 = the curvature as captured.",
                             bounds=(0, 1e6))
    trust_radius: float = setting(0.0, "solver=em only: keep each mode within ½(w−s)ᵀΛ̄(w−s)/N ≤ trust_radius of its "
                                       "start s, in the clients' own metric Λ̄ (their precisions, weighted by the "
                                       "responsibilities at s): the clients' quadratics predict at most this many nats "
                                       "per sample of extra loss anywhere inside; 0 = no region.", bounds=(0, 1e6))

    prior_centre: str = setting("auto", "Where the over-counted prior is divided out.", choices=PriorCentre)
    server_prior: str = setting("auto", "The server prior's precision: how hard the modes are pulled to the prior "
                                        "centre.", choices=ServerPrior)

    def validate(self) -> None:
        super().validate()
        if self.trust_radius > 0 and self.solver == "adam":
            raise ConfigError("setting trust_radius needs solver=em")
        if self.server_prior == "evidence" and self.solver == "adam":
            raise ConfigError("setting server_prior=evidence needs solver=em (the evidence is taken at stationary points)")
        if self.laplace_prior != "server" and not self.laplace:
            raise ConfigError("setting laplace_prior=evidence needs laplace=true")
        if self.mode_weights == "laplace" and not self.laplace:
            raise ConfigError("setting mode_weights=laplace needs laplace=true")


VALIDATION_FREE_STRUCTURES = ("kron",)  # where solver=auto without validation data runs EM (measured better there)


def resolve_auto(settings: FedBEnsSettings, has_val: bool, structure: str = "kron") -> FedBEnsSettings:
    """``settings`` with every ``auto`` replaced by what runs. ``solver=auto`` is EM at a stationary point when
    the server has no validation data and the clients' curvature is Kronecker (:data:`VALIDATION_FREE_STRUCTURES`),
    or when a setting asks for EM (``server_prior=evidence``, ``trust_radius``); then ``prior_centre`` /
    ``server_prior`` left at ``auto`` take the validation-free fusion's ``clients`` / ``evidence``
    (``experiments/without_validation/``: without validation data Adam keeps its best-objective iterate,
    which under strong heterogeneity predicts far worse on K-FAC curvature). Otherwise it is the paper's Adam
    (with validation data its best validation iterate): on diagonal curvature the stationary point predicts
    far worse than Adam's early iterates, validation or not (same study). An explicit ``solver``
    keeps the paper's ``zero`` centre and the clients' λ0 unless they are set; an explicit ``adam`` where
    ``auto`` would run the validation-free fusion is warned about once."""
    validation_free = not has_val and structure in VALIDATION_FREE_STRUCTURES
    if settings.solver == "adam" and validation_free:
        warnings.warn("fedbens solver=adam without validation data: Adam keeps its best-objective iterate, "
                      "which under strong heterogeneity can predict far worse than the paper's best-validation one "
                      "(experiments/without_validation/); the default solver=auto runs the stationary fusion that "
                      "needs no validation data (EM, prior_centre=clients, server_prior=evidence)", stacklevel=4)
    auto_em = settings.solver == "auto" and (validation_free or settings.server_prior == "evidence"
                                             or settings.trust_radius > 0)
    solver = settings.solver if settings.solver != "auto" else ("em" if auto_em else "adam")
    centre = settings.prior_centre if settings.prior_centre != "auto" else ("clients" if auto_em else "prior")
    prior = settings.server_prior if settings.server_prior != "auto" else ("evidence" if auto_em else "clients")
    return dataclasses.replace(settings, solver=solver, prior_centre=centre, server_prior=prior)
