"""The prior centred at a pretrained base, N(w_b, λ0⁻¹ I): training's weight decay, the artifact, the refresh
round and every fusion method where the prior's centre enters — each against a dense float64 reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import TINY, TINY_LAYOUT, client, dense_neg_log_posterior, random_curvature, random_psd
from torch import nn
from torch.nn.utils import parameters_to_vector

import posterior_fusion
from posterior_fusion.artifact import Component, write_client_artifact
from posterior_fusion.curvature import BlockDiag, Dense, Diag
from posterior_fusion.errors import ArtifactError, IncompatibleArtifactsError
from posterior_fusion.fusion import METHODS, FusionInputs, FusionOptions
from posterior_fusion.fusion.compatibility import check_compatible
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings
from posterior_fusion.fusion.methods.hbfl import HBFLSettings
from posterior_fusion.fusion.methods.swag_product import SwagProductSettings
from posterior_fusion.local.fit_config import TrainConfig
from posterior_fusion.local.refresh import newton_centre, step_ratio
from posterior_fusion.local.train import train_map
from posterior_fusion.posterior import SwagMoments

F64 = dict(dtype=torch.float64)
TS, LAMS = [0.5, 1.0, 0.25], [2.0, 0.5, 1.0]  # unequal temperatures and prior precisions per client


def _base_clients(structure: str, M: int = 1, seed: int = 0, swag: bool = False):
    """Three clients of TINY fine-tuned from one base ``b`` ``(d,)``: random MAPs near it, random curvature,
    unequal T and λ; returns ``(clients, b)``."""
    gen = torch.Generator().manual_seed(seed)
    d = TINY_LAYOUT.dim
    b = torch.randn(d, generator=gen, **F64)
    out = []
    for c, (T, lam) in enumerate(zip(TS, LAMS)):
        comps = []
        for m in range(M):
            moments = None
            if swag:
                dev = 0.3 * torch.randn(4, d, generator=gen, **F64)
                mean = b + torch.randn(d, generator=gen, **F64)
                moments = SwagMoments(mean, mean.square() + 0.2 + torch.rand(d, generator=gen, **F64), dev)
            comps.append(Component(m, b + torch.randn(d, generator=gen, **F64), _curvature(structure, gen), {},
                                   T, lam, moments))
        out.append(dataclasses.replace(client(comps, structure, n=10 + c, T=T, lam=lam, name=f"c{c}"), prior_mean=b))
    return out, b


def _curvature(structure: str, gen: torch.Generator) -> BlockDiag:
    """diag+full: a diagonal block over W1, b1 and a dense one over W2, b2; diag and kron as conftest's."""
    if structure != "diag+full":
        return random_curvature(structure, gen)
    return BlockDiag([Diag(torch.rand(15, generator=gen, **F64)), Dense(random_psd(TINY_LAYOUT.dim - 15, gen))])


def _dense(comp: Component, T: float) -> torch.Tensor:
    return torch.block_diag(*[blk.to_dense().double() for blk in comp.curvature.blocks]) / T


@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_product_over_a_base_prior_is_the_dense_gaussian_product(structure):
    """Π_c N(ŵ_c, Λ_c⁻¹) / N(w_b, λ_c⁻¹ I) · N(w_b, λ0⁻¹ I) in dense float64: its mean is the method's."""
    clients, b = _base_clients(structure)
    d, eye = TINY_LAYOUT.dim, torch.eye(TINY_LAYOUT.dim, **F64)
    lam0 = sorted(LAMS)[1]  # the server prior: the clients' median λ0
    precs = [_dense(c.components[0], T) + lam * eye for c, T, lam in zip(clients, TS, LAMS)]
    H = sum(precs) - (sum(LAMS) - lam0) * eye
    rhs = sum(P @ c.components[0].map for P, c in zip(precs, clients)) - (sum(LAMS) - lam0) * b
    ref = torch.linalg.solve(H, rhs)
    got = METHODS["product"](FusionInputs(clients, FusionOptions(progress=False))).members[0].double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the zero-centred product differs: the base is not a no-op
    zero = [dataclasses.replace(c, prior_mean=None) for c in clients]
    assert (METHODS["product"](FusionInputs(zero, FusionOptions(progress=False))).members[0].double() - ref).abs().max() > 1e-2
    assert d == ref.numel()


@pytest.mark.parametrize("structure", ["diag", "diag+full", "kron"])
def test_fedbens_modes_over_a_base_prior_are_the_dense_minimisers(structure):
    """One component per client: the product is Gaussian and fedbens' EM mode (prior_centre=prior) is the dense
    minimiser with every prior centred at the base. Two components per client: each EM mode is a stationary
    point of the dense float64 negative log posterior with the base-centred priors."""
    clients, b = _base_clients(structure, M=1, seed=1)
    eye = torch.eye(TINY_LAYOUT.dim, **F64)
    lam0 = sorted(LAMS)[1]
    precs = [_dense(c.components[0], T) + lam * eye for c, T, lam in zip(clients, TS, LAMS)]
    E = (sum(LAMS) - lam0) * eye
    ref = torch.linalg.solve(sum(precs) - E, sum(P @ c.components[0].map for P, c in zip(precs, clients)) - E @ b)
    settings = FedBEnsSettings(solver="em", prior_centre="prior", server_prior="clients", steps=200, laplace=False)
    res = METHODS["fedbens"](FusionInputs(clients, FusionOptions(progress=False)), settings)
    torch.testing.assert_close(res.members[0].double(), ref, rtol=1e-4, atol=1e-4)

    two, b2 = _base_clients(structure, M=2, seed=2)
    res = METHODS["fedbens"](FusionInputs(two, FusionOptions(progress=False)), settings)
    for w in res.members:
        x = w.double().clone().requires_grad_(True)
        value = dense_neg_log_posterior_per_client(two, x, lam0, b2)
        (g,) = torch.autograd.grad(value, x)
        assert float(g.norm()) < 1e-3 * max(1.0, float(x.detach().norm())), float(g.norm())
        x0 = w.double().clone().requires_grad_(True)  # the same point is not stationary with zero-centred priors
        (g0,) = torch.autograd.grad(dense_neg_log_posterior_per_client(two, x0, lam0, None), x0)
        assert float(g0.norm()) > 1e-2


def dense_neg_log_posterior_per_client(clients, w, lam0, centre):
    """:func:`conftest.dense_neg_log_posterior` with each client's own T (it takes one T for all):
    ``−Σ_c log q_c(w) + Σ_c log N(w; μ, λ_c⁻¹ I) − log N(w; μ, λ0⁻¹ I)``."""
    d = w.shape[-1]
    mu0 = torch.zeros(d, **F64) if centre is None else centre
    prior = lambda lam: torch.distributions.MultivariateNormal(mu0, precision_matrix=lam * torch.eye(d, **F64))  # noqa: E731
    total = -prior(lam0).log_prob(w)
    for c, T, lam in zip(clients, TS, LAMS):
        # one client with its own λ as the server's: its prior is counted once and divided out once, −log q_c(w)
        total = total + dense_neg_log_posterior([c], w, T, [lam], lam, centre) + prior(lam).log_prob(w)
    return total


def test_hbfl_divides_out_a_base_prior():
    """HBFL's eq. 3.8 with the prior N(w_b, λ⁻¹ I): η_k = (G_k/T_k + λ_k) ŵ_k − λ_k w_b; dense float64 closed form."""
    clients, b = _base_clients("diag+full", seed=3)
    n = torch.tensor([float(c.n_data) for c in clients], **F64)
    q = n / n.sum()
    Gs = [_dense(c.components[0], T) for c, T in zip(clients, TS)]
    H = sum(qk * G for qk, G in zip(q, Gs))
    eta = sum(qk * (G @ c.components[0].map + lam * (c.components[0].map - b))
              for qk, G, c, lam in zip(q, Gs, clients, LAMS))
    got = METHODS["hbfl"](FusionInputs(clients, FusionOptions(progress=False)), HBFLSettings(prior_scale=0.0))
    torch.testing.assert_close(got.members[0].double(), torch.linalg.solve(H, eta), rtol=1e-4, atol=1e-4)


def test_swag_product_over_a_base_prior_is_the_dense_product():
    """The SWAG Gaussians' product over the over-counted prior N(w_b, λ⁻¹ I), from dense covariances."""
    clients, b = _base_clients("diag", seed=4, swag=True)
    d, eye = TINY_LAYOUT.dim, torch.eye(TINY_LAYOUT.dim, **F64)
    lam0 = sorted(LAMS)[1]
    P, rhs = (lam0 - sum(LAMS)) * eye, (lam0 - sum(LAMS)) * b
    for c in clients:
        s = c.components[0].swag
        K = s.deviations.shape[0]
        cov = torch.diag(s.diag_variance / 2) + s.deviations.T @ s.deviations / (2 * (K - 1))
        prec = torch.linalg.inv(cov)
        P, rhs = P + prec, rhs + prec @ s.mean
    got = METHODS["swag-product"](FusionInputs(clients, FusionOptions(progress=False)), SwagProductSettings())
    torch.testing.assert_close(got.members[0].double(), torch.linalg.solve(P, rhs), rtol=1e-4, atol=1e-4)
    assert d == got.members[0].numel()


def test_refresh_round_centre_and_gain_ratio_use_the_base():
    """ŵ = w* − (G/T + λI)⁻¹ (g/T + λ (w* − w_b)) and the gain ratio of f(w) = L(w)/T + ½ λ ‖w − w_b‖², dense."""
    gen = torch.Generator().manual_seed(5)
    d, T, lam = 7, 0.5, 2.0
    G = torch.rand(d, generator=gen, **F64) + 0.1
    w, g, b = (torch.randn(d, generator=gen, **F64) for _ in range(3))
    curv = BlockDiag([Diag(G)])
    centre = newton_centre(w, curv, g, T, lam, prior_mean=b)
    P = torch.diag(G / T) + lam * torch.eye(d, **F64)
    torch.testing.assert_close(centre, w - torch.linalg.solve(P, g / T + lam * (w - b)), rtol=1e-12, atol=1e-12)
    L_w, L_c = 3.0, 2.5
    s = centre - w
    predicted = -(float((g / T + lam * (w - b)) @ s) + 0.5 * float(s @ P @ s))
    actual = (L_w - L_c) / T + 0.5 * lam * (float((w - b) @ (w - b)) - float((centre - b) @ (centre - b)))
    assert math.isclose(step_ratio(w, centre, curv, g, T, lam, L_w, L_c, prior_mean=b), actual / predicted,
                        rel_tol=1e-10)


def test_training_decays_toward_the_base():
    """One full-batch SGD step (no momentum) of CE + ½ wd ‖w − w_b‖², by autograd, equals train_map's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    w0 = parameters_to_vector(model.parameters()).detach().clone()
    b = torch.randn_like(w0)
    cfg = TrainConfig(epochs=1, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.3)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    torch.nn.utils.vector_to_parameters(w0.clone(), ref.parameters())
    loss = nn.functional.cross_entropy(ref(x), y)
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    g = torch.cat([t.reshape(-1) for t in grads]) + 0.3 * (w0 - b)
    train_map(model, x, y, cfg, seed=0, prior_mean=b)
    torch.testing.assert_close(parameters_to_vector(model.parameters()).detach(), w0 - 0.1 * g, rtol=1e-6, atol=1e-6)


def test_artifact_keeps_the_prior_mean_and_checks_it(tmp_path):
    """Written, read back equal; a mis-shaped or non-finite /prior_mean is one line naming the path; clients with
    different prior centres are not fused together."""
    import h5py

    clients, b = _base_clients("diag", seed=6)
    meta = {"n_data": 10, "temperature": 0.5, "prior_precision": 2.0, "structure": "diag",
            "class_counts": [10, 0]}
    path = tmp_path / "c.h5"
    write_client_artifact(path, TINY, TINY_LAYOUT, meta, clients[0].components, prior_mean=b)
    art = posterior_fusion.load(path)
    torch.testing.assert_close(art.prior_mean.double(), b.float().double(), rtol=0, atol=0)
    write_client_artifact(tmp_path / "z.h5", TINY, TINY_LAYOUT, meta, clients[0].components)
    assert posterior_fusion.load(tmp_path / "z.h5").prior_mean is None
    for bad in (torch.zeros(TINY_LAYOUT.dim + 1), torch.full((TINY_LAYOUT.dim,), float("nan"))):
        with h5py.File(path, "r+") as f:
            del f["prior_mean"]
            f.create_dataset("prior_mean", data=bad.numpy())
        with pytest.raises(ArtifactError) as exc:
            posterior_fusion.load(path)
        assert "/prior_mean" in str(exc.value) and "\n" not in str(exc.value)
    moved = [clients[0], dataclasses.replace(clients[1], prior_mean=b + 1), clients[2]]
    with pytest.raises(IncompatibleArtifactsError, match="one prior"):
        check_compatible(moved)
    with pytest.raises(IncompatibleArtifactsError, match="one prior"):
        check_compatible([clients[0], dataclasses.replace(clients[1], prior_mean=None)])
