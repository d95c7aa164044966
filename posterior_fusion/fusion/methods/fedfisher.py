"""FedFisher (Jhunjhunwala et al.): one model minimising Σ_c ½ (w − ŵ_c)ᵀ G_c (w − ŵ_c).

G_c is the raw client curvature (K-FAC, diag or diag+full). ``solver = "adam"`` (the paper's): Adam
starts from FedAvg and the best validation iterate is kept (else the best objective); ``"exact"``:
the minimiser (Σ G_c + ε I)⁻¹ (Σ G_c ŵ_c + ε w_FedAvg) itself, layer by layer (``fusion/quadratic.py``).
"""

from __future__ import annotations

from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.methods.fedavg import fedavg_weights
from posterior_fusion.fusion.quadratic import QuadraticSettings, minimise_quadratic, quadratic_bytes
from posterior_fusion.fusion.types import FusionInputs, FusionResult


def fedfisher(inputs: FusionInputs, settings: QuadraticSettings) -> FusionResult:
    comps = [c.components[inputs.options.component] for c in inputs.clients]
    return minimise_quadratic(comps, [1.0] * len(comps), inputs, settings, "fedfisher",
                              fedavg_weights(inputs).double())


METHOD = FusionMethod("fedfisher", fedfisher, QuadraticSettings,
                      "one model minimising the sum of client curvature quadratics (FedFisher)", optimises=True,
                      work_bytes=quadratic_bytes)
