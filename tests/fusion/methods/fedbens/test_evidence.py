"""FedBEns' evidence: its prior stays above the curvatures' float32 resolution."""

from __future__ import annotations

import torch
from conftest import fit_split, poisoned_copy

import posterior_fusion
from posterior_fusion.curvature import Kron
from posterior_fusion.data.silo import SiloData
from posterior_fusion.fusion import FusionOptions, fuse


def test_evidence_prior_stays_above_the_curvatures_float32_resolution(tmp_path, small_silo, monkeypatch):
    """A client whose curvature is 1e6× the others' (float32 storage: its rounding is ~1e-8 of its largest
    eigenvalue, far above a weak prior) used to make EM's summed precision indefinite under the evidence's
    prior (a LinAlgError from the default fusion without validation data, on these clients). Each λ0_j now stays ≥ RESOLUTION ×
    the block's largest summed curvature (an upper bound computed independently here from eigenvalues: dense ones,
    or a Kronecker factor pair's),
    and the default fusion runs."""
    import warnings

    from posterior_fusion.fusion.methods import fedbens as fedbens_module
    from posterior_fusion.fusion.methods.fedbens import RESOLUTION

    # the floor is applied to every round's λ0_j: three rounds of at most five EM iterations show it, on the
    # images at 7 × 7 (every fourth pixel: d = 970), where EM's solves are small
    monkeypatch.setattr(fedbens_module.evidence, "EVIDENCE_ROUNDS", 3)
    silo = SiloData(small_silo.x[:300, ::4, ::4].copy(), small_silo.y[:300], "fmnist", 10)
    paths = fit_split(tmp_path, silo, 4, 75, "kron", mixtures=2, epochs=2, kwargs={"in_features": 49, "hidden": 16})
    scaled = poisoned_copy(paths[0], tmp_path / "scaled.h5", curvature_scale=1e6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, res, meta = fuse([scaled, *paths[1:]], "fedbens", FusionOptions(progress=False), {"steps": 5})
    assert meta["resolved"]["server_prior"] == "evidence"
    clients = [posterior_fusion.load(p) for p in [scaled, *paths[1:]]]
    lam0 = meta["laplace"]["server_prior_precision"]

    def largest(block) -> float:  # of a PSD block; a Kronecker product's is the product of its factors' largest
        if isinstance(block, Kron):
            return float(torch.linalg.eigvalsh(block.B.double())[-1] * torch.linalg.eigvalsh(block.A.double())[-1])
        return float(torch.linalg.eigvalsh(block.to_dense().double())[-1])

    for j in range(len(lam0)):
        top = sum(sum(largest(comp.curvature.blocks[j]) for comp in c.components)
                  / (c.num_components * c.temperature) for c in clients)
        assert lam0[j] >= RESOLUTION * top * (1 - 1e-6) or meta["server_prior_search"]["block_scales"][j] == 0
    assert all(torch.isfinite(w).all() for w in res.members)
