"""The plain ensemble: every component of every client as a member (prediction averaging)."""

from __future__ import annotations

from posterior_fusion.fusion.settings import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionMethod, FusionResult


def ensemble(inputs: FusionInputs, settings: MethodSettings) -> FusionResult:
    return FusionResult([comp.map.float().clone() for c in inputs.clients for comp in c.components])


METHOD = FusionMethod("ensemble", ensemble, MethodSettings,
                      "all C x M client models averaged (serving cost C x M models)",
                      members=lambda settings, size: size.clients * size.components)
