"""FedLPA (Liu et al., NeurIPS 2024, "FedLPA: One-shot Federated Learning with Layer-Wise
Posterior Aggregation"): each client's layer posterior is a Gaussian whose precision is a
damped Kronecker product, and the server takes, layer by layer, the mean of their product.

For a weight of matrix shape ``(out, in)`` with client MAPs ``W_c`` and per-sample-mean K-FAC
factors ``B_c`` ``(out, out)`` (output side) and ``A_c`` ``(in, in)`` (input side), each damped by
``d`` (the authors' ``sqrt(1 − coor)``, ``coor = 0.999`` in their scripts: ``d ≈ 0.0316``):

    B̃_c = B_c / n_c + d I ,   Ã_c = A_c + d I ,   f_c = n_c / Σ n

    Σ_c f_c B̃_c W Ã_c = Z := Σ_c f_c B̃_c W_c Ã_c          (the "Newton" estimate; solved here)
    W ≈ B̄⁻¹ Z Ā⁻¹ ,  B̄ = Σ_c f_c B̃_c ,  Ā = Σ_c f_c Ã_c     (the "expectation approximation")

The authors (``experiments_our.py``) start from the expectation approximation and run 10,000
plain gradient steps on ``MSE(Σ_c f_c B̃_c W Ã_c, Z)``; this module solves the same linear system
(an SPD operator: a sum of Kronecker products of SPD factors) by conjugate gradients
preconditioned with ``Ā⁻¹ ⊗ B̄⁻¹`` from the same start, in float64, to ``tolerance``. Their
script reports the better of the two estimates *on the test set*; here one is chosen by the
``estimate`` setting (or on validation data with ``estimate = "validation"``).

Differences from the authors' code, all forced by what an artifact holds and named here:
- The curvature is the artifact's (the GGN, exact or Monte-Carlo, with either K-FAC flavour),
  not their optimiser's running empirical-Fisher statistics.
- A bias is its own block (the artifacts keep weight and bias apart): its client precision is
  ``f_c (1 + d) B̃_c`` (the bias column of their homogeneous input factor has ``E[1] = 1``, damped;
  the common ``1 + d`` cancels in the mean), without the cross term ``E[u]`` that couples it to
  the weight in their augmented factor.
- For a convolution our factors split the positions as laplace-torch does (A: mean patch
  covariance over samples and positions; B: sum over positions), their optimiser divides A by the
  number of positions S once more and multiplies G by S; the product is the same, the damping
  weighs differently.
- Parameters without a Kronecker block (normalisation layers, prior-only blocks) take the
  n-weighted mean of the clients, as their code does for everything outside Linear/Conv2d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from posterior_fusion.curvature import Dense, Kron
from posterior_fusion.fusion.layer_solve import solve_kron_sum
from posterior_fusion.fusion.settings import MethodSettings, setting
from posterior_fusion.fusion.types import FusionInputs, FusionMethod, FusionResult, require_structures

ESTIMATES = ("newton", "expectation", "validation")


@dataclass(frozen=True)
class FedLPASettings(MethodSettings):
    damping: float = setting(math.sqrt(1 - 0.999), "d added to each per-sample-mean Kronecker factor (the authors' "
                                                   "sqrt(1 - coor), coor = 0.999 in their scripts).", bounds=(0, 1e6))
    estimate: str = setting("newton", "newton: solve the layer's aggregation system exactly; expectation: the "
                                      "authors' closed-form approximation B̄⁻¹ Z Ā⁻¹; validation: the one of the two "
                                      "with the better validation accuracy (newton without validation data).",
                            choices=ESTIMATES)
    tolerance: float = setting(1e-10, "Relative residual at which the conjugate-gradient solve stops.",
                               bounds=(1e-15, 1e-2))
    max_iterations: int = setting(1000, "Conjugate-gradient iterations per layer at most.", bounds=(1, 100_000))


def _damped(F: torch.Tensor, d: float) -> torch.Tensor:
    return F + d * torch.eye(F.shape[0], dtype=F.dtype)


def solve_layer(Bs: list[torch.Tensor], As: list[torch.Tensor], Ws: list[torch.Tensor], f: torch.Tensor,
                tolerance: float, max_iterations: int, newton: bool = True) -> tuple[torch.Tensor, int, float]:
    """One layer's aggregate ``W (out, in)`` from damped factors ``Bs[c] (out, out)``, ``As[c] (in, in)``,
    MAPs ``Ws[c] (out, in)`` and weights ``f (C,)``; returns ``(W, iterations, relative residual)``:
    ``Σ_c f_c B_c W A_c = Σ_c f_c B_c W_c A_c`` by preconditioned conjugate gradients
    (:func:`~posterior_fusion.fusion.layer_solve.solve_kron_sum`) from the authors' expectation
    approximation ``B̄⁻¹ Z Ā⁻¹``; ``newton=False`` returns that start."""
    Z = sum(fc * (B @ W @ A) for fc, B, A, W in zip(f, Bs, As, Ws))
    return solve_kron_sum(Bs, As, f, Z, tolerance=tolerance, max_iterations=max_iterations if newton else 0)


def aggregate(inputs: FusionInputs, settings: FedLPASettings, newton: bool) -> tuple[torch.Tensor, dict]:
    """The FedLPA parameter vector ``(d,)`` (float64) and per-layer solver records."""
    m = inputs.options.component
    clients, d = inputs.clients, settings.damping
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    f = n / n.sum()
    out = (f[:, None] * torch.stack([c.components[m].map.double() for c in clients])).sum(0)  # FedAvg elsewhere
    ref = clients[0].components[m].curvature
    solves = []
    for j, (block, off) in enumerate(zip(ref.blocks, ref.offsets)):
        maps = [c.components[m].map[off: off + block.dim].double() for c in clients]
        blocks = [c.components[m].curvature.blocks[j] for c in clients]
        if isinstance(block, Kron):  # plain or compressed Kronecker blocks
            Bs = [_damped(b.B.double() / nc, d) for b, nc in zip(blocks, n)]
            As = [_damped(b.A.double(), d) for b in blocks]
            W, it, res = solve_layer(Bs, As, [w.reshape(block.shape) for w in maps], f, settings.tolerance,
                                     settings.max_iterations, newton)
            out[off: off + block.dim] = W.reshape(-1)
            solves.append({"offset": off, "shape": list(block.shape), "iterations": it, "residual": res})
        elif isinstance(block, Dense):  # a bias: its own block, precision ∝ f_c B̃_c
            Ps = [fc * _damped(b.G.double() / nc, d) for b, fc, nc in zip(blocks, f, n)]
            out[off: off + block.dim] = torch.linalg.solve(sum(Ps), sum(P @ w for P, w in zip(Ps, maps)))
    return out, {"fedlpa_solves": solves}


def fedlpa(inputs: FusionInputs, settings: FedLPASettings) -> FusionResult:
    require_structures(inputs, METHOD.structures, "fedlpa", " (it aggregates K-FAC layer posteriors)")
    if settings.estimate != "validation":
        w, info = aggregate(inputs, settings, newton=settings.estimate == "newton")
        return FusionResult([w.float()], {**info, "fedlpa_estimate": settings.estimate})
    candidates = {name: aggregate(inputs, settings, newton=name == "newton") for name in ("newton", "expectation")}
    scores = None
    chosen = "newton"
    if inputs.val is not None:
        from posterior_fusion.metrics import evaluate_members

        scores = {name: evaluate_members(inputs.spec, [w.float()], inputs.val)["accuracy"]
                  for name, (w, _) in candidates.items()}
        chosen = max(scores, key=lambda k: (scores[k], k == "newton"))
    w, info = candidates[chosen]
    return FusionResult([w.float()], {**info, "fedlpa_estimate": chosen, "fedlpa_val_accuracy": scores})


METHOD = FusionMethod("fedlpa", fedlpa, FedLPASettings,
                      "layer-wise product of damped K-FAC Gaussians, solved per layer (FedLPA)", structures=("kron",))
