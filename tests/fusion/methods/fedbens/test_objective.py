"""FedBEns' objective (fusion/methods/fedbens/objective.py) against dense float64 and pooled-data references."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_LAYOUT, dense_neg_log_posterior, linear_gaussian_clients, random_clients, structured_clients

import posterior_fusion
from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionInputs,
    FusionOptions,
)
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings, GlobalLogPosterior
from posterior_fusion.fusion.mode_laplace import negative_log_posterior

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


@pytest.mark.parametrize("ragged", [False, True], ids=["M=2", "M=1,2,3"])
@pytest.mark.parametrize("chunk_bytes", [0, 1, None], ids=["all-clients-at-once", "client-by-client", "default"])
@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_fedbens_objective_and_gradient_vs_dense_float64(structure, chunk_bytes, ragged):
    clients = random_clients(structure, C=3, M=3 if ragged else 2, seed=0)
    if ragged:  # clients with different numbers of components (the per-client softmax has no common shape)
        clients = [dataclasses.replace(c, components=c.components[: i + 1]) for i, c in enumerate(clients)]
    lams = [2.0, 3.0, 1.5]  # per-client priors: the general form of the prior correction
    obj = GlobalLogPosterior(clients, [0.5] * 3, lams, 2.5, dtype=torch.float64, chunk_bytes=chunk_bytes)
    assert len(obj.chunks(4, 8)) == (3 if chunk_bytes == 1 else 1)
    gen = torch.Generator().manual_seed(5)
    W = (torch.randn(4, TINY_LAYOUT.dim, generator=gen, dtype=torch.float64) * 0.5).requires_grad_(True)
    ours = obj(W)
    ref = torch.stack([dense_neg_log_posterior(clients, w, 0.5, lams, 2.5) for w in W])
    # Objectives agree up to one constant (normalisers of the global posterior are dropped nowhere here).
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-8)
    # the value the fedbens records at its modes, from the clients' blocks (no stack; what EM reports)
    torch.testing.assert_close(negative_log_posterior(clients, [0.5] * 3, lams, 2.5, W), ref.detach(), rtol=1e-10, atol=1e-8)
    g_ours = torch.autograd.grad(ours.sum(), W, retain_graph=True)[0]
    weights = torch.tensor([0.5, -2.0, 0.0, 3.0], dtype=torch.float64)  # rows are independent: a weighted sum scales them
    torch.testing.assert_close(torch.autograd.grad((weights * ours).sum(), W)[0], weights[:, None] * g_ours)
    Wr = W.detach().clone().requires_grad_(True)
    g_ref = torch.autograd.grad(torch.stack([dense_neg_log_posterior(clients, w, 0.5, lams, 2.5) for w in Wr]).sum(), Wr)[0]
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-9, atol=1e-9)


def test_fedbens_recovers_pooled_posterior():
    clients, mu, L = linear_gaussian_clients()
    obj = GlobalLogPosterior(clients, [1.0] * 3, [2.0] * 3, 2.0, dtype=torch.float64)
    # The global objective is exactly the pooled Gaussian up to a constant ...
    gen = torch.Generator().manual_seed(1)
    W = mu + torch.randn(6, mu.numel(), generator=gen, dtype=torch.float64)
    diff = obj(W) - 0.5 * torch.einsum("ki,ij,kj->k", W - mu, L, W - mu)
    torch.testing.assert_close(diff, diff[0].expand_as(diff), rtol=0, atol=1e-8)
    # ... and the server's Adam finds its mode.
    res = fedbens(FusionInputs(clients, FusionOptions(progress=False)), FedBEnsSettings(steps=3000, adam_lr=0.01, clip=100.0,
                                                                                              solver="adam"))
    torch.testing.assert_close(res.members[0].double(), mu, rtol=0, atol=2e-2)


def test_fedbens_one_client_one_component_stays_at_its_map():
    clients, _, _ = linear_gaussian_clients(C=1)
    res = fedbens(FusionInputs(clients, FusionOptions(progress=False)), FedBEnsSettings(steps=2000, adam_lr=0.01, clip=100.0))
    torch.testing.assert_close(res.members[0].double(), clients[0].components[0].map, rtol=0, atol=2e-2)


def test_retempering_changes_fedbens_objective(fitted):
    _, paths = fitted
    clients = [posterior_fusion.load(p) for p in paths]
    W = torch.stack([c.components[0].map for c in clients]) + 0.05
    a = GlobalLogPosterior(clients, [0.1] * 3, [10.0] * 3, 10.0)(W)
    b = GlobalLogPosterior(clients, [1.0] * 3, [10.0] * 3, 10.0)(W)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("structure", ["kron", "diag+full"])
def test_component_densities_of_float32_clients_decompose_each_block_once(structure, monkeypatch):
    """EM's responsibilities, the objective at the modes and the Laplace step evaluate every client component
    at every iteration: on float32 artifacts (what a silo writes) the log-determinants come in float64 from
    the client blocks' own cached eigenvalues — one decomposition per factor over all calls, not one per call
    on a float64 copy (at width 64 that was minutes per EM mode) — and equal the float64 clients' densities."""
    from posterior_fusion.fusion.mode_laplace import component_log_densities

    clients = structured_clients(structure, C=2, M=2, seed=3)
    as32 = [dataclasses.replace(c, components=tuple(dataclasses.replace(comp, map=comp.map.float(),
                                                                        curvature=comp.curvature.astype(torch.float32))
                                                    for comp in c.components)) for c in clients]
    W = torch.randn(3, TINY_LAYOUT.dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = component_log_densities(clients, [0.5, 0.5], [2.0, 2.0], W)
    calls = {"n": 0}
    for name in ("eigvalsh", "eigh"):
        real = getattr(torch.linalg, name)

        def counted(*a, _real=real, **k):
            calls["n"] += 1
            return _real(*a, **k)
        monkeypatch.setattr(torch.linalg, name, counted)
    first = component_log_densities(as32, [0.5, 0.5], [2.0, 2.0], W)
    after_first = calls["n"]
    again = component_log_densities(as32, [0.5, 0.5], [2.0, 2.0], W)
    assert after_first > 0 and calls["n"] == after_first  # the second call decomposes nothing
    for a, b, r in zip(first, again, ref):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-3)  # float32 factors, float64 arithmetic
