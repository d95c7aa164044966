"""How ``evaluate`` and ``predict`` query a global artifact (:mod:`posterior_fusion.predictive`), declared once and
free of torch."""

from __future__ import annotations

from dataclasses import dataclass

from posterior_fusion import ranges
from posterior_fusion.choices import Link, Predictive
from posterior_fusion.settings import setting


@dataclass(frozen=True)
class PredictiveSettings:
    """The predictive a global serves: its members averaged, sampled around each mode, or linearised."""

    predictive: str = setting("map", "How the global predicts (costs: docs/benchmarks.md).", choices=Predictive)
    samples: int = setting(30, "Samples per mode for mc (and for the glm predictive's mc link).", bounds=ranges.SAMPLES)
    link: str = setting("probit", "The glm predictive's link.", choices=Link)
    scale: float = setting(1.0, "Multiply the posterior covariance (predictive tempering; 1 = the posterior).",
                           bounds=ranges.PREDICTIVE_SCALE)


@dataclass(frozen=True)
class CalibrationSettings:
    """How ``evaluate`` measures calibration."""

    bins: int = setting(15, "ECE/MCE bins.", bounds=ranges.BINS)
