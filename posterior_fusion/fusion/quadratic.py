"""One model minimising a sum of client quadratics, the aggregation of FedFisher and HBFL:

    f(w) = ½ Σ_k (w − m_k)ᵀ s_k G_k (w − m_k) − wᵀ b        (G_k a client's curvature, s_k > 0)

``solver = "adam"`` runs FedFisher's server optimiser (Adam from the anchor, FedAvg; with validation
data the best validation iterate, else the lowest objective: :func:`~posterior_fusion.fusion.optimise.optimise_modes`).
``solver = "exact"`` returns the stationary point itself, ``(Σ_k s_k G_k + ε I) w = Σ_k s_k G_k m_k + b + ε a``,
block by block (:func:`~posterior_fusion.fusion.layer_solve.solve_precision_sum`: a Kronecker weight by
conjugate gradients, a diagonal or dense block in closed form), with ε = ``prior_scale`` × the block's
mean curvature: a prior N(a, ε⁻¹ I) per block, its precision relative to the block's curvature, pulling
directions no client has curvature in to the anchor ``a`` (FedAvg): no step size, no early stopping, no
dependence on validation data. ``tune_prior_scale`` instead solves at each scale of :data:`PRIOR_SCALE_GRID`
(largest first, each solve started from the previous one's answer) and keeps the one with the best
validation accuracy.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from posterior_fusion.choices import Choice
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.gaussian_stack import StackedGaussians
from posterior_fusion.fusion.layer_solve import solve_precision_sum
from posterior_fusion.fusion.method_type import FuseSize, optimiser_bytes
from posterior_fusion.fusion.optimise import OptimiserSettings, accuracy_of, optimise_modes
from posterior_fusion.fusion.settings_parsing import setting
from posterior_fusion.fusion.types import FusionInputs, FusionResult
from posterior_fusion.progress import progress


class QuadraticSolver(Choice):
    """How a sum of client quadratics is minimised."""

    ADAM = "adam", "FedFisher's server Adam from FedAvg (best validation iterate, else the best objective)"
    EXACT = "exact", ("the quadratic's stationary point, solved layer by layer (conjugate gradients for Kronecker "
                      "curvature, closed form otherwise)")


UNCONVERGED = 1e-6  # a relative residual above this after the solve is reported
PRIOR_SCALE_GRID = (1.0, 0.3, 0.1, 0.03, 0.01, 3e-3, 1e-3)  # tune_prior_scale's candidates, largest (best conditioned) first


@dataclass(frozen=True)
class QuadraticSettings(OptimiserSettings):
    """Settings of a method that minimises a sum of client quadratics (FedFisher, HBFL)."""

    solver: str = setting("adam", "How the sum of the clients' quadratics is minimised.", choices=QuadraticSolver)
    prior_scale: float = setting(1e-8, "Exact solves (and HBFL's closed forms): a prior N(FedAvg, ε⁻¹ I) per curvature "
                                       "block with ε = prior_scale × the block's mean curvature, pulling directions "
                                       "without curvature to FedAvg; on K-FAC curvature use 1e-3 or more (0.01 on the "
                                       "ResNet-20 runs: docs/methods.md).", bounds=(0, 1e6))

    tune_prior_scale: bool = setting(False, "solver=exact with validation data (--val): solve at each prior_scale of "
                                            "1, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001 and keep the best validation "
                                            "accuracy (prior_scale is then not used).")

    def validate(self) -> None:
        super().validate()
        if self.tune_prior_scale and self.solver != "exact":
            raise ConfigError("setting 'tune_prior_scale' needs solver=exact")


def quadratic_bytes(settings: QuadraticSettings, size: FuseSize) -> int:
    """Working set beyond the loaded artifacts: Adam's (:func:`optimiser_bytes`), or for the exact solve
    about eight float64 vectors of ``d`` (solution, anchor, linear term, start, a layer's right-hand side
    and conjugate-gradient vectors; one layer's float64 factor copies are small beside them)."""
    return 8 * size.d * 8 if settings.solver == "exact" else optimiser_bytes(settings, size)


def minimise_quadratic(comps: list, scales: list[float], inputs: FusionInputs, settings: QuadraticSettings,
                       desc: str, anchor: torch.Tensor, linear: torch.Tensor | None = None) -> FusionResult:
    """The minimiser ``(d,)`` of ``f`` (module docstring) for the components ``comps`` (``.curvature``
    ``G_k``, ``.map`` ``m_k``) with weights ``scales`` ``s_k``, anchor ``anchor`` ``(d,)`` float64 (FedAvg:
    Adam's start, the prior's centre) and linear term ``linear`` ``b`` ``(d,)`` (default none)."""
    if settings.solver == "exact":
        terms = [(1.0, c.curvature.with_scale_shift(float(s), 0.0), c.map) for c, s in zip(comps, scales)]
        if not settings.tune_prior_scale:
            w, info = solve_precision_sum(terms, rhs=linear, prior_scale=settings.prior_scale, prior_centre=anchor,
                                          start=anchor, desc=f"{desc} exact solve" if inputs.options.progress else None)
            _check_converged(info, desc, settings.prior_scale)
            return FusionResult([w.float()], {"solver": "exact", **info})
        return _tuned(terms, linear, anchor, inputs, desc)
    opts = inputs.options
    stack = StackedGaussians(comps, scale=[float(s) for s in scales], shift=0.0,
                             kernel=opts.kernel, show_progress=opts.progress).to(opts.device)
    b = None if linear is None else linear.float().to(opts.device)

    def objective(W: torch.Tensor) -> torch.Tensor:  # (K, d) -> (K,)
        value = 0.5 * stack.quadratic_forms(W).sum(-1)
        return value if b is None else value - W @ b

    best, history = optimise_modes(objective, anchor.float()[None], inputs, settings, desc)
    return FusionResult([best[0].clone()], {"history": history})


def _check_converged(info: dict, desc: str, prior_scale: float) -> None:
    if info["residual"] > UNCONVERGED:
        warnings.warn(f"{desc}: the exact solve stopped at relative residual {info['residual']:.2g} (1,000 "
                      f"conjugate-gradient steps in a layer): the quadratic is nearly singular there and the "
                      f"result is unreliable; raise `prior_scale` (now {prior_scale:g})", stacklevel=3)


def _tuned(terms: list, linear: torch.Tensor | None, anchor: torch.Tensor, inputs: FusionInputs,
           desc: str) -> FusionResult:
    """The exact solve at every scale of :data:`PRIOR_SCALE_GRID`, the best on validation kept; ``info``
    records the chosen ``prior_scale`` and every candidate's validation accuracy (``prior_scale_search``)."""
    if inputs.val is None:
        raise ConfigError(f"{desc}: setting 'tune_prior_scale' chooses the prior scale on validation data; pass `val`")
    best, start, search = None, anchor, []
    for scale in progress(PRIOR_SCALE_GRID, f"{desc} prior_scale", len(PRIOR_SCALE_GRID),
                          show=inputs.options.progress):
        w, info = solve_precision_sum(terms, rhs=linear, prior_scale=scale, prior_centre=anchor, start=start)
        accuracy = float(accuracy_of(inputs.spec, w.float()[None], inputs.val)[0])
        search.append({"prior_scale": scale, "val_accuracy": accuracy, **info})
        if best is None or accuracy > best[0]:
            best = (accuracy, scale, w, info)
        start = w  # the next, smaller scale starts from this answer
    accuracy, scale, w, info = best
    _check_converged(info, desc, scale)
    return FusionResult([w.float()], {"solver": "exact", "prior_scale": scale, "prior_scale_search": search, **info})
