"""FedPPD's server step, one round (paper ``002``, Algorithms 2 and 3), on the students that
``pfuse fit-local --ppd`` stores beside the MAPs (``/components/<m>/ppd_student``).

``fedppd``: the n-weighted average of the clients' students of component ``--component``
(Algorithm 2, the student half). ``fedppd-distill``: the ensemble of every client's students
distilled into one model on unlabeled server data with the shared distillation tool (FedBE's
SWA schedule; Algorithm 3 also distils a teacher ensemble of the MAPs and Gaussian samples,
which ``fedbe`` provides on its own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from posterior_fusion import ranges
from posterior_fusion.errors import ConfigError, MethodNotApplicableError
from posterior_fusion.fusion.common import FusionInputs, FusionMethod, FusionResult
from posterior_fusion.fusion.distill import DistillConfig, distill
from posterior_fusion.fusion.settings import MethodSettings, setting


def _students(inputs: FusionInputs, method: str, components: list[int]) -> list[list[torch.Tensor]]:
    out = []
    for c in inputs.clients:
        row = []
        for m in components:
            comp = c.components[m]
            if comp.student is None:
                raise MethodNotApplicableError(f"method {method!r} needs FedPPD students; {c.path} component {m} has "
                                               "none (fit-local --ppd)")
            row.append(comp.student.float())
        out.append(row)
    return out


def fedppd(inputs: FusionInputs, settings: MethodSettings) -> FusionResult:
    students = torch.stack([row[0] for row in _students(inputs, "fedppd", [inputs.options.component])])
    w = (inputs.n_weights()[:, None] * students).sum(0)
    return FusionResult([w], {"students": len(students)})


@dataclass(frozen=True)
class FedPPDDistillSettings(MethodSettings):
    distill_epochs: int = setting(20, "Distillation epochs on the unlabeled server data (FedBE's schedule).", bounds=ranges.EPOCHS)
    sharpen: float = setting(2.0, "Pseudo-label sharpening power (1 = none).", bounds=(1e-3, 1e3))

    def validate(self) -> None:
        if self.distill_epochs < 0 or not self.sharpen > 0:
            raise ConfigError("fedppd-distill settings need distill_epochs >= 0 and sharpen > 0")


def fedppd_distill(inputs: FusionInputs, settings: FedPPDDistillSettings) -> FusionResult:
    if inputs.unlabeled is None:
        raise MethodNotApplicableError("method 'fedppd-distill' needs unlabeled server data (--unlabeled FILE)")
    rows = _students(inputs, "fedppd-distill", list(range(inputs.clients[0].num_components)))
    teachers = torch.stack([w for row in rows for w in row])
    start = (inputs.n_weights()[:, None] * torch.stack([row[0] for row in rows])).sum(0)
    cfg = replace(DistillConfig(), epochs=settings.distill_epochs, sharpen=settings.sharpen)
    w, record = distill(inputs.spec, teachers, start, inputs.unlabeled.inputs(), cfg,
                        torch.Generator().manual_seed(inputs.options.sampling_seed), inputs.options.progress)
    return FusionResult([w], {"distill": record})


METHOD = FusionMethod("fedppd", fedppd, MethodSettings, "FedPPD: n-weighted average of the clients' PPD students")
DISTILL_METHOD = FusionMethod("fedppd-distill", fedppd_distill, FedPPDDistillSettings,
                              "FedPPD: the clients' PPD students distilled into one model on unlabeled data")
