"""FedFisher (Jhunjhunwala et al.): one model minimising Σ_c ½ (w − ŵ_c)ᵀ G_c (w − ŵ_c).

G_c is the raw client curvature (K-FAC, diag or diag+full); Adam starts from FedAvg and the
best validation iterate is kept (else the best objective).
"""

from __future__ import annotations

from posterior_fusion.fusion.methods.fedavg import fedavg_weights
from posterior_fusion.fusion.optimise import OptimiserSettings, optimise_modes
from posterior_fusion.fusion.stack import StackedGaussians
from posterior_fusion.fusion.types import FusionInputs, FusionMethod, FusionResult, optimiser_bytes


def fedfisher(inputs: FusionInputs, settings: OptimiserSettings) -> FusionResult:
    m = inputs.options.component
    opts = inputs.options
    stack = StackedGaussians([c.components[m] for c in inputs.clients], scale=1.0, shift=0.0,
                             kernel=opts.kernel, show_progress=opts.progress).to(opts.device)

    def objective(W):
        return 0.5 * stack.quadratic_forms(W).sum(-1)

    best, history = optimise_modes(objective, fedavg_weights(inputs)[None], inputs, settings, "fedfisher")
    return FusionResult([best[0].clone()], {"history": history})


METHOD = FusionMethod("fedfisher", fedfisher, OptimiserSettings,
                      "one model minimising the sum of client curvature quadratics (FedFisher)", optimises=True,
                      work_bytes=optimiser_bytes)
