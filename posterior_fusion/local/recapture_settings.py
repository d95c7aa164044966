"""What ``pfuse recapture`` and ``pfuse refresh`` capture, declared once and free of torch: each a fit setting
(:class:`~posterior_fusion.local.fit_config.FitConfig`'s help) that defaults to the source artifact's own."""

from __future__ import annotations

from dataclasses import dataclass

from posterior_fusion import ranges
from posterior_fusion.choices import CaptureMethod, GgnType, KfacType, Structure
from posterior_fusion.local.fit_config import FitConfig
from posterior_fusion.settings import declared_help, setting

SOURCE = " [default: the source artifact's]"


@dataclass(frozen=True)
class CaptureChoice:
    """The capture a recapture or a refresh round runs; ``None``: what the source artifact recorded (``kfac``:
    expand where it records none)."""

    structure: str | None = setting(None, declared_help(FitConfig, "structure") + SOURCE, choices=Structure)
    ggn: str | None = setting(None, declared_help(FitConfig, "ggn") + SOURCE, choices=GgnType)
    capture: str = setting("fast", declared_help(FitConfig, "capture"), choices=CaptureMethod)
    curvature_batch_size: int | None = setting(None, declared_help(FitConfig, "curvature_batch_size") + SOURCE,
                                               bounds=ranges.BATCH_SIZE)
    kfac: str | None = setting(None, declared_help(FitConfig, "kfac") + SOURCE, choices=KfacType)
