"""FedBEns' starts (fusion/methods/fedbens/starts.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LAYOUT, client

import posterior_fusion
from posterior_fusion.artifact import Component
from posterior_fusion.curvature import BlockDiag, Diag
from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionInputs,
    FusionOptions,
)
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings, GlobalLogPosterior

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


@pytest.mark.parametrize("starts", ["clients", "median+clients"])
def test_fedbens_starts_from_client_maps(fitted, starts):
    """More global modes than M: one Adam run per client component's MAP (and the medians)."""
    folder, paths = fitted
    clients = [posterior_fusion.load(p) for p in paths]
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    res0 = fedbens(inputs, FedBEnsSettings(steps=0, laplace=False, starts=starts))
    maps = [comp.map for c in clients for comp in c.components]
    medians = [torch.stack([c.components[m].map for c in clients]).median(0).values for m in range(2)]
    want = maps if starts == "clients" else medians + maps
    assert len(res0.members) == len(want)
    for got, w in zip(res0.members, want):
        torch.testing.assert_close(got, w)
    res = fedbens(inputs, FedBEnsSettings(steps=20, laplace=True, starts=starts, solver="adam"))
    assert len(res.members) == len(want) == len(res.curvatures)
    obj = GlobalLogPosterior(clients, [c.temperature for c in clients], [c.prior_precision for c in clients],
                             clients[0].prior_precision)
    with torch.no_grad():
        assert (obj(torch.stack(res.members)) <= obj(torch.stack(want)) + 1e-3).all()


def test_prior_centre_follows_each_start_component():
    """`starts=clients` with M = 2 and unequal λ_c: in the flat coordinates each of the C·M modes is the
    λ-weighted client average of the component index it starts from (rows client-major)."""
    gen = torch.Generator().manual_seed(4)
    d, lams = TINY_LAYOUT.dim, [1.0, 2.0, 4.0]
    g = torch.full((d,), 1e4, dtype=torch.float64)
    g[:6] = 0.0
    cl = [client([Component(m, 3.0 * m + torch.randn(d, generator=gen, dtype=torch.float64), BlockDiag([Diag(g)]), {},
                            0.5, lam) for m in range(2)], "diag", lam=lam, name=f"c{i}") for i, lam in enumerate(lams)]
    res = fedbens(FusionInputs(cl, FusionOptions(progress=False)),
                  FedBEnsSettings(solver="em", laplace=False, steps=100, starts="clients", prior_centre="clients"))
    lam = torch.tensor(lams, dtype=torch.float64)
    for row, w in enumerate(res.members):
        m = row % 2
        want = (lam[:, None] * torch.stack([c.components[m].map[:6] for c in cl])).sum(0) / lam.sum()
        torch.testing.assert_close(w[:6].double(), want, rtol=1e-4, atol=1e-4)
