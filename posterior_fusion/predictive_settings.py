"""How ``evaluate`` and ``predict`` query a global artifact (:mod:`posterior_fusion.predictive`), declared once and
free of torch."""

from __future__ import annotations

from dataclasses import dataclass

from posterior_fusion import ranges
from posterior_fusion.choices import LINKS, PREDICTIVES
from posterior_fusion.settings import setting


@dataclass(frozen=True)
class PredictiveSettings:
    """The predictive a global serves: its members averaged, sampled around each mode, or linearised."""

    predictive: str = setting(
        "map", "map: average the members' softmax; mc: Monte-Carlo over weight samples around each mode; glm: "
               "linearised predictive (needs a fedbens artifact with its Laplace posterior); glm-last-layer: the same "
               "with only the last Linear layer uncertain (faster; docs/benchmarks.md).", choices=PREDICTIVES)
    samples: int = setting(30, "Samples per mode for mc (and for the glm predictive's mc link).", bounds=ranges.SAMPLES)
    link: str = setting("probit", "glm: probit approximation or Monte-Carlo over the Gaussian logits.", choices=LINKS)
    scale: float = setting(1.0, "Multiply the posterior covariance (predictive tempering; 1 = the posterior).",
                           bounds=ranges.PREDICTIVE_SCALE)


@dataclass(frozen=True)
class CalibrationSettings:
    """How ``evaluate`` measures calibration."""

    bins: int = setting(15, "ECE/MCE bins.", bounds=ranges.BINS)
