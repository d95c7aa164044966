"""FedFisher (Jhunjhunwala et al.): one model minimising Σ_c ½ (w − ŵ_c)ᵀ G_c (w − ŵ_c).

G_c is the raw client curvature (K-FAC, diag or diag+full); Adam starts from FedAvg and the
best validation iterate is kept (else the best objective).
"""

from __future__ import annotations

from posterior_fusion.fusion.baselines import fedavg
from posterior_fusion.fusion.common import FusionInputs, FusionResult
from posterior_fusion.fusion.fedbens import optimise_modes
from posterior_fusion.fusion.stack import StackedGaussians


def fedfisher(inputs: FusionInputs) -> FusionResult:
    m = inputs.options.mode_index
    opts = inputs.options
    stack = StackedGaussians([c.components[m] for c in inputs.clients], scale=1.0, shift=0.0,
                             backend=opts.kernel).to(opts.device)

    def objective(W):
        return 0.5 * stack.quadratic_forms(W).sum(-1)

    start = fedavg(inputs).members[0][None]
    best, history = optimise_modes(objective, start, inputs, "fedfisher")
    return FusionResult([best[0].clone()], {"history": history})
