"""FedPPD's server step, one round (paper ``002``, Algorithms 2 and 3), on the students that
``pfuse fit-local --ppd`` stores beside the MAPs (``/components/<m>/ppd_student``).

``fedppd``: the n-weighted average of the clients' students of component ``--component``
(Algorithm 2, the student half). ``fedppd-distill``: Algorithm 3's student half — the ensemble
E_S = {w̄} ∪ {w_i} ∪ {w_j ~ p(w|D)}_{j=1}^S of the averaged student w̄, every client's student w_i
of component ``--component`` and S draws from a diagonal Gaussian p(w|D) fitted to the students
(n-weighted mean and variance, as FedBE fits its own), distilled into w̄ on unlabeled server data
with the shared distillation tool (FedBE's SWA schedule). Only one component per client enters:
the paper's clients all start from one global model, and so do the clients' components of one
index; averaging students of different components (different starts) gives a network that
predicts near-uniformly (measured: 10 % on Fashion-MNIST). Algorithm 3's teacher half (the same
on the MAPs) is ``fedbe``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from posterior_fusion import ranges
from posterior_fusion.errors import ConfigError, MethodNotApplicableError
from posterior_fusion.fusion.distill import DistillConfig, distill
from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.settings_parsing import MethodSettings, setting
from posterior_fusion.fusion.types import FusionInputs, FusionResult


def _students(inputs: FusionInputs, method: str, components: list[int]) -> list[list[torch.Tensor]]:
    out = []
    for c in inputs.clients:
        row = []
        for m in components:
            comp = c.components[m]
            if comp.student is None:
                raise MethodNotApplicableError(f"method {method!r} needs FedPPD students; {c.path} component {m} has "
                                               "none (fit-local `ppd`)")
            row.append(comp.student.float())
        out.append(row)
    return out


def fedppd(inputs: FusionInputs, settings: MethodSettings) -> FusionResult:
    students = torch.stack([row[0] for row in _students(inputs, "fedppd", [inputs.options.component])])
    w = (inputs.n_weights()[:, None] * students).sum(0)
    return FusionResult([w], {"students": len(students)})


@dataclass(frozen=True)
class FedPPDDistillSettings(MethodSettings):
    num_samples: int = setting(10, "Students S drawn from the Gaussian fitted to the client students (Algorithm 3's M).",
                               bounds=(0, 1_000_000))
    distill_epochs: int = setting(20, "Distillation epochs on the unlabeled server data (FedBE's schedule).", bounds=ranges.EPOCHS)
    sharpen: float = setting(2.0, "Pseudo-label sharpening power (1 = none).", bounds=(1e-3, 1e3))

    def validate(self) -> None:
        super().validate()
        if self.distill_epochs < 0 or not self.sharpen > 0:
            raise ConfigError("fedppd-distill settings need distill_epochs >= 0 and sharpen > 0")


def student_ensemble(inputs: FusionInputs, num_samples: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
    """Algorithm 3's E_S ``(1 + C + S, d)``: the averaged student w̄, every client's student of
    component ``--component`` and S draws from the diagonal Gaussian fitted to the students; with
    a label per member."""
    m = inputs.options.component
    W = torch.stack([row[0] for row in _students(inputs, "fedppd-distill", [m])])   # (C, d)
    p = inputs.n_weights()[:, None].to(W.dtype)                                    # n_c / N
    mean = (p * W).sum(0)                                                          # w̄
    var = (p * (W - mean).square()).sum(0)
    samples = mean + var.sqrt() * torch.randn(num_samples, mean.numel(), generator=generator)
    labels = (["average"] + [f"client {c} student {m}" for c in range(W.shape[0])]
              + [f"sample {j}" for j in range(num_samples)])
    return torch.cat([mean[None], W, samples]), labels


def fedppd_distill(inputs: FusionInputs, settings: FedPPDDistillSettings) -> FusionResult:
    if inputs.unlabeled is None:
        raise MethodNotApplicableError("method 'fedppd-distill' needs unlabeled server data (`unlabeled` FILE)")
    gen = torch.Generator().manual_seed(inputs.options.sampling_seed)
    teachers, labels = student_ensemble(inputs, settings.num_samples, gen)
    cfg = replace(DistillConfig(), epochs=settings.distill_epochs, sharpen=settings.sharpen)
    w, record = distill(inputs.spec, teachers, teachers[0], inputs.unlabeled.inputs(), cfg, gen,
                        inputs.options.progress)
    return FusionResult([w], {"distill": record, "ensemble": labels})


METHOD = FusionMethod("fedppd", fedppd, MethodSettings, "FedPPD: n-weighted average of the clients' PPD students",
                      needs=("students",))
DISTILL_METHOD = FusionMethod("fedppd-distill", fedppd_distill, FedPPDDistillSettings,
                              "FedPPD (Algorithm 3): averaged student, client students and Gaussian samples "
                              "distilled into one model on unlabeled data", distils=True,
                              needs=("unlabeled", "students"))
