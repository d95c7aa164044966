"""A component's log_prob, written to disk and read back, equals laplace-torch's own log_prob."""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace
from laplace.curvature import AsdlGGN, CurvlinopsGGN
from torch.nn.utils import parameters_to_vector

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.laplace import _loader
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component


@pytest.mark.parametrize("structure,backend", [("kron", CurvlinopsGGN), ("diag", AsdlGGN)])
@pytest.mark.parametrize("model,kwargs", [("lenet", {}), ("mlp", {"hidden": 12, "bias": True})])
def test_log_prob_matches_laplace_torch(tmp_path, small_silo, structure, backend, model, kwargs):
    spec = ModelSpec(model, kwargs)
    torch.manual_seed(0)
    net = spec.build()
    x, y = small_silo.tensors()
    x, y = x[:200], y[:200]
    T, lam = 0.1, 10.0
    w_map = parameters_to_vector(net.parameters()).detach().clone()
    comp = Component(0, w_map, capture(structure, net, x, y, batch_size=64, method="laplace")[0], {}, T, lam)
    meta = {"n_data": 200, "class_counts": [20] * 10, "temperature": T, "prior_precision": lam, "structure": structure}
    write_client_artifact(tmp_path / "a.h5", spec, ParameterLayout.from_model(net), meta, [comp])
    loaded = posterior_fusion.load(tmp_path / "a.h5").components[0]

    la = Laplace(copy.deepcopy(net), "classification", subset_of_weights="all", hessian_structure=structure,
                 backend=backend, temperature=T, prior_precision=lam)
    la.fit(_loader(x, y, 64))
    gen = torch.Generator().manual_seed(1)
    for scale in (0.0, 0.01, 0.1):
        w = w_map + scale * torch.randn(w_map.shape, generator=gen)
        ref = la.log_prob(w).double()
        ours = loaded.log_prob(w).double()
        torch.testing.assert_close(ours, ref, rtol=2e-5, atol=1e-2)
    torch.testing.assert_close(loaded.precision().logdet().double(), la.log_det_posterior_precision.double(), rtol=1e-5, atol=1e-2)


def test_diag_full_last_block_is_exact_ggn(small_silo):
    """diag+full: the last block equals the exact GGN of the last layer (dense float64 Jacobian reference)."""
    spec = ModelSpec("mlp", {"hidden": 8, "bias": False})
    torch.manual_seed(0)
    net = spec.build().double()
    x, y = small_silo.tensors()
    x = x[:50].double()
    curv = capture("diag+full", net, x, y[:50], batch_size=16, method="laplace")[0]
    H = curv.blocks[-1].G
    # GGN of summed cross-entropy for the last linear layer W (10x8): J = I ⊗ h, Hess of CE = diag(p) - p pᵀ.
    feats = net[:3](x)  # (n, 8) hidden activations
    probs = torch.softmax(net(x), -1)
    ref = torch.zeros(80, 80, dtype=torch.float64)
    for h, p in zip(feats, probs):
        L = torch.diag(p) - torch.outer(p, p)
        ref += torch.kron(L, torch.outer(h, h))
    torch.testing.assert_close(H.double(), ref, rtol=1e-6, atol=1e-8)
    assert curv.blocks[0].dim == parameters_to_vector(net.parameters()).numel() - 80


@pytest.mark.parametrize("model,kwargs", [("lenet", {}), ("mlp", {"hidden": 12, "bias": True})])
def test_last_layer_glm_equals_laplace_torch(small_silo, model, kwargs):
    """`glm-last-layer` equals laplace-torch's last-layer GLM predictive (``subset_of_weights="last_layer"``, full
    Hessian) on the same MAP and precision: laplace-torch's own posterior precision over the last layer becomes the
    last block of ours (``Λ = H_factor·H + λ I``), the rest of the network any diagonal (it is not read). Logit
    means and covariances against ``_glm_predictive_distribution``, probit probabilities against ``la(x)``."""
    from posterior_fusion.curvature import BlockDiag, Dense, Diag
    from posterior_fusion.predictive import last_layer_moments, probit

    spec = ModelSpec(model, kwargs)
    torch.manual_seed(0)
    net = spec.build()
    x, y = small_silo.tensors()
    T, lam = 0.1, 10.0
    la = Laplace(copy.deepcopy(net), "classification", subset_of_weights="last_layer", hessian_structure="full",
                 temperature=T, prior_precision=lam)
    la.fit(_loader(x[:200], y[:200], 64))
    raw_ll = (la._H_factor * la.H).double()  # (p, p): the last layer's tempered GGN, weight row-major then bias
    w = parameters_to_vector(net.parameters()).detach()
    rest = w.numel() - raw_ll.shape[0]
    prec = BlockDiag([Diag(torch.ones(rest, dtype=torch.float64)), Dense(raw_ll)]).precision(1.0, lam)
    torch.testing.assert_close(prec.blocks[-1].to_dense().double(), la.posterior_precision.double(), rtol=1e-6, atol=1e-6)
    xt = x[200:264]
    mean, cov = last_layer_moments(spec, w, prec, xt, batch_size=16)
    f_mu, f_var = la._glm_predictive_distribution(xt)
    torch.testing.assert_close(mean, f_mu.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cov, f_var.double(), rtol=1e-4, atol=1e-6)
    ref = la(xt, pred_type="glm", link_approx="probit")
    torch.testing.assert_close(probit(mean, cov).float(), ref.float(), rtol=1e-4, atol=1e-6)
