"""What a client artifact reveals about its silo (``pfuse audit FILE --data SILO``), measured by the data
owner before sharing it. Three readings, each an attack a server could run on the artifact alone:

- **label distribution**: the class counts the artifact stores (for the label-shift pool) are the silo's,
  exactly;
- **input statistics**: a K-FAC artifact's first-layer input factor A = Σ uuᵀ / (N·S) is the second-moment
  matrix of the silo's inputs (its image patches for a convolution). Reported: how much of the silo's own
  leading k input directions A's leading k eigenvectors span, ``‖U_Aᵀ V‖²_F / k`` in [0, 1], beside the same
  for another silo's directions (``--other``), so the owner sees how specific to their data it is;
- **membership**: a loss-threshold attack against the artifact's networks (their averaged prediction):
  the silo's samples (members) against samples the silo never trained on (``--holdout``), scored by the
  negative cross-entropy within each class (a skewed silo is not told apart by its labels); reported as the
  ROC AUC (0.5: no signal) and the true-positive rate at a 1 % false-positive rate, class-weighted as the
  silo's samples.

Nothing here changes an artifact; no differential privacy is applied (docs/security.md).
"""

from __future__ import annotations

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.curvature import Kron
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import DataError
from posterior_fusion.metrics import auroc, ensemble_probabilities
from posterior_fusion.models.layers import SUPPORTED_LAYERS, input_columns
from posterior_fusion.models.members import build_model

TOP_DIRECTIONS = 5  # k: the leading input directions compared


def leading_directions(second_moment: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` leading eigenvectors ``(I, k)`` of a symmetric PSD ``(I, I)`` matrix, float64."""
    _, vecs = torch.linalg.eigh(second_moment.double())
    return vecs[:, -k:]


def subspace_overlap(U: torch.Tensor, V: torch.Tensor) -> float:
    """``‖Uᵀ V‖²_F / k`` for orthonormal ``U``, ``V`` ``(I, k)``: 1 when they span the same subspace, about
    k / I for unrelated ones."""
    return float((U.T @ V).square().sum() / U.shape[1])


def first_layer_moment(art: ClientPosterior, data: SiloData) -> torch.Tensor:
    """The second moment ``(I, I)`` of the inputs of the artifact's first Linear/Conv2d on ``data`` (its
    columns as the capture sees them: patches for a convolution), float64 — A's counterpart from data."""
    model = build_model(art.model_spec, art.components[0].map)
    first = next((m for m in model.modules() if isinstance(m, SUPPORTED_LAYERS)
                  and any(True for _ in m.parameters(recurse=False))), None)
    if first is None:
        raise DataError(f"{art.path}: the model has no Linear or Conv2d layer with parameters")
    total, count = None, 0
    seen: list[torch.Tensor] = []
    handle = first.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    try:
        with torch.no_grad():
            x = data.inputs()
            for start in range(0, len(x), 256):
                seen.clear()
                model(x[start: start + 256])
                cols = input_columns(first, seen[0]).double()  # (I, M·S)
                part = cols @ cols.T
                total = part if total is None else total + part
                count += cols.shape[1]
    finally:
        handle.remove()
    return total / count


def artifact_first_factor(art: ClientPosterior) -> torch.Tensor | None:
    """The first Kronecker block's input factor A ``(I, I)`` of component 0 (None without one: diag)."""
    for block in art.components[0].curvature.blocks:
        if isinstance(block, Kron) and isinstance(getattr(block, "A", None), torch.Tensor):
            return block.A.double()
    return None


def membership(art: ClientPosterior, members: SiloData, holdout: SiloData) -> dict:
    """The loss-threshold attack: ROC AUC of −CE(members) against −CE(holdout) under the artifact's networks'
    averaged prediction, and the true-positive rate at the threshold with a 1 % false-positive rate — both
    within each class and averaged with the members' class weights, so a silo whose labels are skewed against
    the held-out set's is not "found" by its label distribution (which the counts reveal anyway)."""
    spec = art.model_spec
    scores, labels = [], []
    for data in (members, holdout):
        x, y = data.tensors()
        probs, _ = ensemble_probabilities(spec, [c.map for c in art.components], x)
        scores.append(torch.log(probs.double().clamp_min(1e-30)).gather(1, y[:, None]).squeeze(1))
        labels.append(y)
    (inside, outside), (y_in, y_out) = scores, labels
    auc = tpr = weight = 0.0
    for k in torch.unique(y_in):
        a, b = inside[y_in == k], outside[y_out == k]
        if len(a) == 0 or len(b) == 0:
            continue
        w = float(len(a))
        auc += w * auroc(torch.cat([a, b]), torch.cat([torch.ones(len(a)), torch.zeros(len(b))]).bool())
        tpr += w * float((a > torch.quantile(b, 0.99)).double().mean())
        weight += w
    if weight == 0:
        raise DataError("the held-out samples share no class with the silo: no membership reading")
    return {"auc": auc / weight, "tpr_at_1pct_fpr": tpr / weight, "members": len(inside), "non_members": len(outside)}


def audit(art: ClientPosterior, data: SiloData, holdout: SiloData | None = None, other: SiloData | None = None,
          k: int = TOP_DIRECTIONS) -> dict:
    """Every reading of the module docstring that the inputs allow (``holdout``: membership; ``other``: the
    input-statistics comparison); ``data`` is the silo the artifact was fitted on."""
    if art.metadata.get("data_sha256") not in (None, data.sha256()):
        raise DataError(f"{data.source or 'data'}: is not the silo {art.path} was fitted on (data SHA-256 differs)")
    out: dict = {"file": art.path, "n_data": art.n_data,
                 "label_distribution": {"stored_counts": list(art.metadata.get("class_counts", [])),
                                        "exact": list(art.metadata.get("class_counts", [])) == data.class_counts()}}
    A = artifact_first_factor(art)
    if A is not None:
        kk = min(k, A.shape[0])
        U = leading_directions(A, kk)
        own = subspace_overlap(U, leading_directions(first_layer_moment(art, data), kk))
        reading = {"directions": kk, "input_dimension": A.shape[0], "overlap_own": own,
                   "overlap_unrelated": kk / A.shape[0]}
        if other is not None:
            reading["overlap_other_silo"] = subspace_overlap(U, leading_directions(first_layer_moment(art, other), kk))
        out["input_statistics"] = reading
    if holdout is not None:
        out["membership"] = membership(art, data, holdout)
    return out


def describe(report: dict) -> list[str]:
    """The report as lines for a terminal."""
    lines = [f"{report['file']}: what it reveals about its silo (n = {report['n_data']})"]
    lab = report["label_distribution"]
    lines.append(f"  label distribution: the class counts {lab['stored_counts']} are stored"
                 + (" — the silo's exactly" if lab["exact"] else ""))
    if "input_statistics" in report:
        r = report["input_statistics"]
        other = (f", another silo's {r['overlap_other_silo']:.2f}" if "overlap_other_silo" in r else "")
        lines.append(f"  input statistics: the first layer's input factor spans {r['overlap_own']:.2f} of the silo's own "
                     f"{r['directions']} leading input directions (unrelated directions: {r['overlap_unrelated']:.2f}"
                     f"{other})")
    else:
        lines.append("  input statistics: no Kronecker factor (a diagonal curvature stores no input second moment)")
    if "membership" in report:
        m = report["membership"]
        lines.append(f"  membership (loss threshold, {m['members']} members against {m['non_members']} held-out): "
                     f"AUC {m['auc']:.3f}, true positives at 1 % false positives {100 * m['tpr_at_1pct_fpr']:.1f} %"
                     + (" — near chance" if abs(m["auc"] - 0.5) < 0.05 else ""))
    return lines

