"""The settings every fusion method shares (:class:`FusionOptions`; each method's own are in its settings record),
declared with :func:`~posterior_fusion.settings.setting` and torch-free: ``pfuse fuse``'s options are generated
from it."""

from __future__ import annotations

from dataclasses import dataclass

from posterior_fusion import ranges
from posterior_fusion.choices import BatchnormStatistics, Device, Kernel
from posterior_fusion.errors import ConfigError
from posterior_fusion.settings import check_declared, setting

DEVICES = (Device.CPU, Device.CUDA)  # the server computes where it is told: no auto


@dataclass(frozen=True)
class FusionOptions:
    """Settings shared by every method (each method's own are in its settings record), declared with
    :func:`~posterior_fusion.settings.setting` like every other setting: one default and one line of help each."""

    temperature: float | None = setting(None, "Re-temper every client: T on the server (None: each client's own T).",
                                        bounds=ranges.TEMPERATURE)
    prior_var: float | None = setting(None, "Re-set every client's prior variance σ0² (None: each client's own).",
                                      bounds=ranges.PRIOR_VAR)
    component: int = setting(0, "The client component the unimodal methods use.", bounds=(0, ranges.COMPONENTS[1] - 1))
    sampling_seed: int = setting(0, "Seed of the server's random draws.", bounds=ranges.SEED)
    kernel: str | None = setting(None, "Kronecker kernel of the optimising methods (None: $PFUSE_KERNEL, else "
                                       "torch).", choices=Kernel)
    device: str = setting("cpu", "Where the optimising methods compute (torch kernels on either unless `kernel` says "
                                 "triton).", choices=DEVICES)
    progress: bool = setting(True, "Show progress lines.")
    batchnorm_statistics: str = setting("fold", "The fused model's BatchNorm statistics where the clients folded "
                                                "theirs (fit-local --batchnorm fold); reset estimates them on the "
                                                "server's unlabeled, else val, inputs.", choices=BatchnormStatistics)
    allow_mixed_privacy: bool = setting(False, "Fuse differentially private clients with non-private ones (the "
                                               "global then carries no guarantee for the non-private clients' data, "
                                               "and its metadata says so).")

    def validate(self) -> None:
        check_declared(self)
        import torch  # here, not at import: the CLI declares its options from this record without torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("`device` cuda is not available here (no GPU)")


@dataclass(frozen=True)
class ServerSteps:
    """What ``fuse`` does around the method itself: screening the clients, and choosing T and σ0² on the server's
    validation data over a grid (:mod:`posterior_fusion.fusion.tuning`)."""

    robust: bool = setting(False, "Screen out clients whose curvature scale (>100x) or MAP distance (>3x) is far from "
                                  "the others' median.")
    tune: str | None = setting(None, "Choose T and/or prior variance on the validation data over a grid: 'T', 'prior' "
                                     "or 'T,prior' [default: no tuning].")
    tune_temperatures: str = setting("0.01,0.03,0.1,0.3,1.0", "Grid of T for tune.")
    tune_prior_vars: str = setting("0.01,0.1,1.0", "Grid of σ0² for tune.")
