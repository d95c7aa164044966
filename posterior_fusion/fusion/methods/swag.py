"""SWAG ensemble: draws from every client component's SWAG Gaussian, as one ensemble."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posterior_fusion.errors import ConfigError, MethodNotApplicableError
from posterior_fusion.fusion.method_type import FusionMethod, never
from posterior_fusion.fusion.settings_parsing import MethodSettings, setting
from posterior_fusion.fusion.types import FusionInputs, FusionResult


@dataclass(frozen=True)
class SwagSettings(MethodSettings):
    num_samples: int = setting(10, "Draws per client component (at least 1).", bounds=(1, 10_000))

    def validate(self) -> None:
        super().validate()
        if self.num_samples < 0:
            raise ConfigError("setting num_samples must be >= 0")


def swag_ensemble(inputs: FusionInputs, settings: SwagSettings) -> FusionResult:
    gen = torch.Generator().manual_seed(inputs.options.sampling_seed)
    members = []
    for c in inputs.clients:
        for comp in c.components:
            if comp.swag is None:
                raise MethodNotApplicableError(f"method 'swag' needs SWAG moments; {c.path} component {comp.index} has none (fit-local `swag`)")
            members.extend(comp.swag.sample(max(1, settings.num_samples), gen).float())
    return FusionResult([w.clone() for w in members])


METHOD = FusionMethod("swag", swag_ensemble, SwagSettings, "samples of every client component's SWAG Gaussian", needs=("swag_moments",),
                      members=lambda settings, size: size.clients * size.components * max(1, settings.num_samples),
                      uses_curvature=never)
