"""The client ensemble: every component of every client as a member.

Its prediction is the plain average of the members (``pooling = "average"``), or, with
``pooling = "label-shift"``, the clients' predictives pooled under label shift from the class
counts their artifacts record (:mod:`posterior_fusion.pooling`): same members, same serving cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posterior_fusion import ranges
from posterior_fusion.choices import PoolingRule
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.settings_parsing import MethodSettings, setting
from posterior_fusion.fusion.types import FusionInputs, FusionResult
from posterior_fusion.pooling import ITERATIONS, Pooling, client_groups


@dataclass(frozen=True)
class EnsembleSettings(MethodSettings):
    pooling: str = setting("average", "How the members' predictions combine (docs/methods.md).",
                            choices=PoolingRule)
    smoothing: float = setting(0.5, "label-shift: s added to the class counts of the clients that saw a class, in "
                                    "their per-class weights only (the label priors are the exact counts).",
                               bounds=ranges.POOLING_SMOOTHING)
    iterations: int = setting(ITERATIONS, "label-shift: the fixed point's Newton steps at most (each input "
                                          "stops once no step moves a log a_c by 1e-11; a warning where the next "
                                          "step would still move a probability by 1e-10).", bounds=ranges.POOLING_ITERATIONS)
    robust: bool = setting(False, "label-shift: resist one lying client — a client that predicts unlike its "
                                  "partners on the classes they share left out of each prediction and named (fuse "
                                  "--robust sets it and checks count claims against curvature; docs/methods.md).")
    target_prior: str = setting("clients", "label-shift: the label prior of the data to be predicted — clients (the "
                                           "pooled clients' class frequencies), uniform, or comma-separated class "
                                           "frequencies (recorded in the artifact; predict and evaluate use it).")

    def validate(self) -> None:
        super().validate()
        self.target_frequencies(None)

    def target_frequencies(self, num_classes: int | None) -> tuple[float, ...]:
        """``()`` for the clients' prior, else one frequency per class (``num_classes`` None: only checks
        the text)."""
        if self.target_prior == "clients":
            return ()
        if self.target_prior == "uniform":
            return () if num_classes is None else (1.0,) * num_classes
        try:
            values = tuple(float(v) for v in self.target_prior.split(","))
        except ValueError:
            raise ConfigError("setting target_prior must be clients, uniform or comma-separated class "
                              f"frequencies; got {self.target_prior[:40]!r}") from None
        if not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0 \
                or (num_classes is not None and len(values) != num_classes):
            raise ConfigError(f"setting target_prior needs {num_classes or 'one per class'} finite frequencies >= 0, "
                              "not all 0")
        return values


def ensemble(inputs: FusionInputs, settings: EnsembleSettings) -> FusionResult:
    members = [comp.map.float().clone() for c in inputs.clients for comp in c.components]
    if settings.pooling == "average":
        return FusionResult(members)
    pooling = Pooling(settings.pooling, client_groups([c.num_components for c in inputs.clients]),
                      tuple(tuple(int(n) for n in c.metadata["class_counts"]) for c in inputs.clients),
                      settings.smoothing, settings.iterations,
                      settings.target_frequencies(inputs.spec.num_classes), settings.robust)
    pooling.validate(len(members), inputs.spec.num_classes)
    return FusionResult(members, {"pooling": pooling.to_metadata()})


METHOD = FusionMethod("ensemble", ensemble, EnsembleSettings,
                      "all C x M client models, averaged or pooled under label shift (serving cost C x M models)",
                      members=lambda settings, size: size.clients * size.components,
                      uses_curvature=lambda settings: settings.robust)
