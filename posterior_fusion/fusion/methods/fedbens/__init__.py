"""FedBEns (Talpini et al.): modes of the product of client mixtures over the over-counted prior.

The method is this package: :mod:`.settings` (its record and the ``auto`` rule), :mod:`.objective`
(the negative log posterior Adam minimises), :mod:`.starts` (where modes start, prior centres),
:mod:`.solvers` (Adam, EM, EM under the evidence prior), :mod:`.evidence` (the server prior's
strength), :mod:`.merging` (starts that end on one mode) and this module (the entry point).

    log p(w | D) = Σ_c [ log q_c(w) − log p0_c(w) ] + log p0(w) + const
    q_c(w) = Σ_m π_cm N(w; ŵ_cm, Λ_cm⁻¹),   Λ_cm = G_cm / T_c + λ0_c I

Dividing the prior N(0, λ⁻¹ I) out C − 1 times is exact for exact client posteriors, but a Laplace
component says N(ŵ_cm, λ_c⁻¹) along directions its curvature does not see, where the true posterior
is the prior N(0, λ_c⁻¹): there the product's mean is Σ_c λ_c ŵ_cm / λ0 ≈ C times the clients'
weights. ``prior_centre = "clients"`` divides the
over-counted prior out at μ_m = Σ_c λ_c ŵ_cm / Σ_c λ_c instead (per mode, from the component index
it starts from): the quadratic term, the precision and the Laplace step are unchanged, and along a
direction no client's curvature sees the mode is μ_m, the clients' average.

With validation data the server runs, by default (``solver = "auto"``), the paper's protocol: one Adam
optimisation per mode index m, started at the element-wise median over clients of ŵ_cm, keeping the
best validation iterate. The M runs are batched: the parameters are a ``(M, d)`` tensor with per-row
gradient clipping, which is the same as M independent Adam runs. Without validation data the default is
the stationary, validation-free fusion instead (:func:`resolve_auto`): EM to a stationary point with the
prior centre at the clients and the server prior from the evidence — Adam's best-objective iterate is
what early stopping would otherwise have to rescue.
"""

from __future__ import annotations

import torch

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.block_stacks import CHUNK_BYTES
from posterior_fusion.fusion.compatibility import require_equal_components
from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.methods.fedbens.evidence import (
    RESOLUTION,
    EvidenceSearch,
    curvature_scales,
    evidence_server_prior,
    server_prior_blocks,
)
from posterior_fusion.fusion.methods.fedbens.fedbens_settings import FedBEnsSettings, resolve_auto
from posterior_fusion.fusion.methods.fedbens.merging import MERGE_TOLERANCE, coinciding_rows, merge_coinciding
from posterior_fusion.fusion.methods.fedbens.objective import GlobalLogPosterior
from posterior_fusion.fusion.methods.fedbens.solvers import solve_modes
from posterior_fusion.fusion.methods.fedbens.starts import (
    client_centres,
    damped_clients,
    median_starts,
    require_shared_inits,
    start_rows,
)
from posterior_fusion.fusion.mode_laplace import (
    evidence_prior_precision,
    laplace_mode_weights,
    mode_precisions,
    negative_log_posterior,
)
from posterior_fusion.fusion.types import FusionInputs, FusionResult

__all__ = ["MERGE_TOLERANCE", "METHOD", "RESOLUTION", "EvidenceSearch", "FedBEnsSettings", "GlobalLogPosterior",
           "client_centres", "coinciding_rows", "curvature_scales", "evidence_server_prior", "fedbens", "median_starts",
           "resolve_auto", "server_prior_blocks", "start_rows"]


def fedbens(inputs: FusionInputs, settings: FedBEnsSettings) -> FusionResult:
    """FedBEns on any curvature structure (kron, diag, diag+full); ``auto`` settings resolved by
    :func:`~.settings.resolve_auto` (what ran is recorded as ``resolved``)."""
    settings = resolve_auto(settings, inputs.val is not None, inputs.clients[0].structure)
    m = require_equal_components(inputs, "fedbens")
    if not settings.allow_different_inits:
        require_shared_inits(inputs)
    modes = settings.modes or m
    if modes > m:
        raise ConfigError(f"setting modes={modes} exceeds the clients' number of components {m}")
    clients = damped_clients(inputs.clients, settings.damping) if settings.damping else inputs.clients
    temps = [inputs.temperature(c) for c in inputs.clients]
    lams = [inputs.prior_precision(c) for c in inputs.clients]
    W0, components = start_rows(inputs, settings.starts, modes)
    mu0 = inputs.prior_mean()  # the clients' prior's centre: None (zero) or the base they fine-tuned
    if settings.prior_centre == "clients":
        centres = client_centres(inputs, components)
    else:  # "prior": where the clients' prior is centred, zero or the base
        centres = None if mu0 is None else mu0.float().expand(len(components), -1).contiguous()
    solved = solve_modes(inputs, settings, clients, temps, lams, inputs.server_prior_precision(), W0, centres)
    best, info, lam0, laplace_step = solved.modes, solved.info, solved.server_prior, solved.laplace_step
    info["resolved"] = {"solver": settings.solver, "prior_centre": settings.prior_centre,
                        "server_prior": settings.server_prior}
    # several starts may end on one mode (with EM, measured: every start of one component index): one member
    # each, weighted by its share of the starts — the predictive of the duplicated rows, once per mode
    groups, share = merge_coinciding(best, components if settings.prior_centre == "clients" else [0] * len(components))
    merged = len(groups) < len(components)
    if merged:
        keep = [g[0] for g in groups]
        best = best[keep]
        centres = None if centres is None else centres[keep]
        if laplace_step is not None:
            laplace_step = ([laplace_step[0][k] for k in keep], [laplace_step[1][k] for k in keep])
        info["members_from_starts"] = groups
        if not settings.laplace:
            info["mode_weights"] = share.tolist()
    if not settings.laplace:
        return FusionResult([w.clone() for w in best], info)
    return _with_laplace(settings, clients, temps, lams, lam0, best, centres, laplace_step, share, merged, info,
                         inputs.options.progress, mu0)


def _with_laplace(settings: FedBEnsSettings, clients, temps, lams, lam0, best: torch.Tensor, centres,
                  laplace_step, share: torch.Tensor, merged: bool, info: dict, show_progress: bool,
                  mu0: torch.Tensor | None = None) -> FusionResult:
    """The result with a Laplace approximation of the global posterior at each mode and the modes' weights
    (``mu0`` ``(d,)``: the model's prior centre, the base; None: zero)."""
    curvatures, errors = laplace_step or mode_precisions(clients, temps, lams, lam0, best, show_progress)
    values = negative_log_posterior(clients, temps, lams, lam0, best, centres)
    laplace = {"prior_precision": lam0, "prior_rule": settings.laplace_prior, "server_prior_precision": lam0,
               "server_prior": settings.server_prior}
    if settings.laplace_prior == "evidence":
        delta, evidence = evidence_prior_precision(list(best if mu0 is None else best.double() - mu0), curvatures)
        laplace.update({"prior_precision": delta, "log_evidence_terms": evidence})
    precisions = [c.precision(1.0, laplace["prior_precision"]) for c in curvatures]
    if settings.mode_weights == "laplace":
        weights = laplace_mode_weights(values, precisions)
        if merged:  # a mode reached from several starts keeps the mass of its rows
            weights = weights * share / (weights * share).sum()
    else:  # equal per start: uniform over the members when no start merged
        weights = share
    info.update({"laplace": {**laplace, "block_relative_errors": errors, "objective_at_modes": values.tolist()},
                 "mode_weights": weights.tolist()})
    return FusionResult([w.clone() for w in best], info, curvatures)


def _modes(settings: FedBEnsSettings, size) -> int:
    """K, the number of global modes: from the median starts, the client components, or both."""
    modes = settings.modes or size.components
    n = size.clients * size.components
    return {"median": modes, "clients": n, "median+clients": modes + n}[settings.starts]


def _work_bytes(settings: FedBEnsSettings, size) -> int:
    """K modes against one chunk of clients at a time (about 3·K·d numbers per component, chunks of
    at most ``default_chunk_bytes`` or one client), K parameter vectors with their gradient, Adam
    moments and best iterate."""
    k = _modes(settings, size)
    per_component = 3 * k * size.d * 4
    n = size.clients * size.components
    chunk = min(n, max(size.components, CHUNK_BYTES // per_component))
    return chunk * per_component + 6 * k * size.d * 4


METHOD = FusionMethod("fedbens", fedbens, FedBEnsSettings, "modes of the product of client mixtures (FedBEns)",
                      optimises=True, members=_modes, work_bytes=_work_bytes, tunable=True, dense_copies=8)
