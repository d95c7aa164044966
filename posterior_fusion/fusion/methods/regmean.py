"""RegMean (Jin et al., "Dataless knowledge fusion by merging weights of language models"),
from the clients' K-FAC input factors. For a merged weight ``(out, in)``:

    W* = (Σ_c W_c G_c)(Σ_c G_c)⁺ ,   G_c = q_c · A_c   (A_c = mean of x xᵀ on client c, q_c = n_c / n)

where every G_c has its off-diagonal entries scaled by α (RegMean's shrinkage).

``protocol = "reference"`` (default) runs it as the FedBEns authors' code does
(``One_shot_FL/algs/regmean.py``): only ``nn.Linear`` weights are merged, every other parameter
(convolutions, biases) is the plain unweighted mean, and α is chosen from ``alpha_grid``
(their {0.1, 0.9}) by validation accuracy (without validation data: the grid's last value).
Their 8-bit quantisation of weights and Grams for communication is not reproduced.
``protocol = "kfac"``: every Kronecker block (convolutions too, whose A is the patch
covariance) is merged with the given ``alpha`` (1.0: no shrinkage), the rest n-averaged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posterior_fusion.choices import Choice
from posterior_fusion.curvature import Kron
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.compatibility import require_structures
from posterior_fusion.fusion.method_type import FusionMethod
from posterior_fusion.fusion.methods.fedavg import fedavg_weights
from posterior_fusion.fusion.settings_parsing import MethodSettings, setting
from posterior_fusion.fusion.types import FusionInputs, FusionResult


class RegMeanProtocol(Choice):
    """Which RegMean."""

    REFERENCE = "reference", ("the FedBEns authors' (nn.Linear weights only, plain mean of the rest, alpha from "
                              "alpha_grid on validation)")
    KFAC = "kfac", "every Kronecker block, n-weighted mean of the rest, the given alpha"




@dataclass(frozen=True)
class RegMeanSettings(MethodSettings):
    protocol: str = setting("reference", "Which layers RegMean merges, and how alpha is set.",
                            choices=RegMeanProtocol)
    alpha: float | None = setting(None, "Scale of the off-diagonal Gram entries (RegMean's α) in [0, 1]; None: "
                                        "reference chooses from alpha_grid, kfac uses 1.0.", bounds=(0, 1))
    alpha_grid: str = setting("0.1,0.9", "Comma-separated α values tried on the validation data (reference).")

    def validate(self) -> None:
        super().validate()
        try:
            grid = [float(a) for a in self.alpha_grid.split(",")]
        except ValueError:
            raise ConfigError("regmean setting alpha_grid must be comma-separated numbers") from None
        if not grid or not all(0 <= a <= 1 for a in grid):
            raise ConfigError("regmean setting alpha_grid needs values in [0, 1]")

    def grid(self) -> list[float]:
        return [float(a) for a in self.alpha_grid.split(",")]


def _shrink(G: torch.Tensor, alpha: float) -> torch.Tensor:
    """Off-diagonal entries times α, the diagonal kept (the reference's ``reduce_non_diag``)."""
    return alpha * G + (1 - alpha) * torch.diag(torch.diagonal(G))


def merge(inputs: FusionInputs, alpha: float, linear_only: bool, plain_mean: bool) -> torch.Tensor:
    """The merged weight vector ``(d,)`` for one α."""
    m = inputs.options.component
    clients = inputs.clients
    if plain_mean:
        out = torch.stack([c.components[m].map.double() for c in clients]).mean(0)
    else:
        out = fedavg_weights(inputs).double()
    ref = clients[0].components[m].curvature
    entries = {e.offset: e for e in clients[0].layout.entries}
    q = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    q = q / q.sum()
    for j, (block, off) in enumerate(zip(ref.blocks, ref.offsets)):
        if not isinstance(block, Kron):  # plain or compressed (CompressedKron) Kronecker blocks
            continue
        entry = entries.get(off)
        if linear_only and (entry is None or len(entry.shape) != 2):  # a convolution weight (out, in, kh, kw)
            continue
        shape = block.shape
        num = torch.zeros(shape, dtype=torch.float64)
        den = torch.zeros(shape[1], shape[1], dtype=torch.float64)
        for qc, c in zip(q, clients):
            comp = c.components[m]
            G = _shrink(qc * comp.curvature.blocks[j].A.double(), alpha)
            num += comp.map[off : off + block.dim].double().reshape(shape) @ G
            den += G
        out[off : off + block.dim] = (num @ torch.linalg.pinv(den, hermitian=True)).reshape(-1)
    return out


def regmean(inputs: FusionInputs, settings: RegMeanSettings) -> FusionResult:
    require_structures(inputs, METHOD.structures, "regmean", " (it needs the K-FAC input factors)")
    reference = settings.protocol == "reference"
    if settings.alpha is not None:
        alphas = [settings.alpha]
    elif reference:
        alphas = settings.grid()
    else:
        alphas = [1.0]
    candidates = [(a, merge(inputs, a, linear_only=reference, plain_mean=reference)) for a in alphas]
    scores = None
    if len(candidates) > 1 and inputs.val is not None:
        from posterior_fusion.metrics import evaluate_members

        scores = [evaluate_members(inputs.spec, [w.float()], inputs.val)["accuracy"] for _, w in candidates]
        best = max(range(len(candidates)), key=lambda i: (scores[i], -i))
    else:
        best = len(candidates) - 1
    alpha, w = candidates[best]
    return FusionResult([w.float()], {"regmean_alpha": alpha, "regmean_val_accuracy": scores,
                                      "regmean_protocol": settings.protocol})


METHOD = FusionMethod("regmean", regmean, RegMeanSettings,
                      "Gram-weighted merge of linear layers from K-FAC input factors (RegMean)", structures=("kron",),
                      dense_copies=6)
