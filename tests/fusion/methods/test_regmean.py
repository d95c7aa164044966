"""RegMean (fusion/methods/regmean.py) by hand, in both protocols."""

from __future__ import annotations

import pytest
import torch
from conftest import client, fit_artifact

import posterior_fusion
from posterior_fusion.artifact import Component
from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionInputs,
    FusionOptions,
)
from posterior_fusion.fusion.methods.regmean import RegMeanSettings
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


def test_regmean_by_hand():
    spec = ModelSpec("mlp", {"in_features": 2, "hidden": 1, "num_classes": 1, "bias": False})
    layout = ParameterLayout.from_model(spec.build())  # W1 (1, 2), W2 (1, 1)
    A1 = torch.tensor([[2.0, 1.0], [1.0, 1.0]])
    A2 = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    W1a, W1b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    cl = []
    for i, (A, W1, w2, n) in enumerate([(A1, W1a, 2.0, 1), (A2, W1b, 4.0, 1)]):
        curv = BlockDiag([Kron(torch.eye(1), A), Kron(torch.eye(1), torch.eye(1))])
        cl.append(client([Component(0, torch.cat([W1, torch.tensor([w2])]), curv, {}, 1.0, 1.0)], "kron", n=n,
                         spec=spec, layout=layout, name=f"r{i}"))
    out = regmean(FusionInputs(cl, FusionOptions()), RegMeanSettings(protocol="kfac")).members[0]
    # (W_a A1 + W_b A2)(A1 + A2)^-1 = [2, 4] @ [[3,1],[1,4]]^-1 = [2, 4] @ [[4,-1],[-1,3]]/11 = [4/11, 10/11]
    torch.testing.assert_close(out[:2], torch.tensor([4 / 11, 10 / 11]))
    assert out[2].item() == pytest.approx(3.0)  # second weight: both A = 1 -> plain mean


def test_regmean_reference_protocol_by_hand(tmp_path, small_silo):
    """The FedBEns authors' RegMean: Linear weights (W Σ G)(Σ G)⁺ with G = q_c A_c, off-diagonals
    times α; convolutions and biases the plain mean; α from the grid by validation accuracy."""
    from posterior_fusion.data.silo import SiloData
    from posterior_fusion.metrics import evaluate_members

    x, y = small_silo.x, small_silo.y
    paths = []
    for c, n in enumerate((40, 80)):
        paths.append(tmp_path / f"l{c}.h5")
        fit_artifact(paths[-1], SiloData(x[c * 100 : c * 100 + n], y[c * 100 : c * 100 + n], "fmnist", 10), "kron",
                     model="lenet", kwargs={"bias": True}, mixtures=1, seed=c)
    cl = [posterior_fusion.load(p) for p in paths]
    val = SiloData(x[-80:], y[-80:], "fmnist", 10)
    res = regmean(FusionInputs(cl, FusionOptions(), val=val))
    got = res.members[0].double()
    q = torch.tensor([40.0, 80.0], dtype=torch.float64) / 120

    def by_hand(alpha):
        w = (cl[0].components[0].map.double() + cl[1].components[0].map.double()) / 2  # plain mean
        blocks = cl[0].components[0].curvature
        for j, (e, off) in enumerate(zip(blocks.blocks, blocks.offsets)):
            entry = next(en for en in cl[0].layout.entries if en.offset == off)
            if e.kind == "kron" and len(entry.shape) == 2:  # Linear weights only
                Gs = [qc * c.components[0].curvature.blocks[j].A.double() for qc, c in zip(q, cl)]
                Gs = [alpha * G + (1 - alpha) * torch.diag(torch.diagonal(G)) for G in Gs]
                Ws = [c.components[0].map[off : off + e.dim].double().reshape(e.shape) for c in cl]
                w[off : off + e.dim] = (sum(W @ G for W, G in zip(Ws, Gs)) @ torch.linalg.pinv(sum(Gs))).reshape(-1)
        return w

    cands = {a: by_hand(a) for a in (0.1, 0.9)}
    accs = {a: evaluate_members(cl[0].model_spec, [w.float()], val)["accuracy"] for a, w in cands.items()}
    chosen = 0.1 if accs[0.1] >= accs[0.9] else 0.9
    assert res.info["regmean_alpha"] == chosen and res.info["regmean_val_accuracy"] == [accs[0.1], accs[0.9]]
    torch.testing.assert_close(got, cands[chosen], rtol=1e-5, atol=1e-6)
    conv = cl[0].layout.entries[0]  # the first convolution: the plain mean, not merged
    assert len(conv.shape) == 4
    sl = slice(conv.offset, conv.offset + conv.size)
    torch.testing.assert_close(got[sl], (cl[0].components[0].map.double()[sl] + cl[1].components[0].map.double()[sl]) / 2)
