"""The SWAG global posterior against the dense Gaussian product in float64."""

from __future__ import annotations

import math

import pytest
import torch

from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion.methods.swag_product import multiply
from posterior_fusion.posterior import SwagMoments


def _moments(d: int, K: int, gen: torch.Generator) -> SwagMoments:
    mean = torch.randn(d, generator=gen, dtype=torch.float64)
    var = 0.05 + torch.rand(d, generator=gen, dtype=torch.float64) * 0.2
    dev = 0.3 * torch.randn(K, d, generator=gen, dtype=torch.float64)
    return SwagMoments(mean, var + mean.square(), dev)


def _dense_cov(m: SwagMoments) -> torch.Tensor:
    K = m.deviations.shape[0]
    cov = 0.5 * torch.diag(m.diag_variance)
    if K > 1:
        cov = cov + m.deviations.T @ m.deviations / (2 * (K - 1))
    return cov


@pytest.mark.parametrize("K", [1, 2, 6])
def test_swag_product_equals_dense_gaussian_product(K):
    gen = torch.Generator().manual_seed(K)
    d, C, lam = 30, 3, 0.5
    moments = [_moments(d, K, gen) for _ in range(C)]
    prod = multiply(moments, [lam] * C, lam)
    precs = [torch.linalg.inv(_dense_cov(m)) for m in moments]
    Lam = sum(precs) - (C - 1) * lam * torch.eye(d, dtype=torch.float64)
    mean = torch.linalg.solve(Lam, sum(P @ m.mean for P, m in zip(precs, moments)))
    torch.testing.assert_close(prod.precision_dense(), Lam, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(prod.mean, mean, rtol=1e-9, atol=1e-9)
    # the sampler's covariance (Woodbury factors) is Λ⁻¹, and draws have that mean and covariance
    torch.testing.assert_close(prod.sampling_covariance_dense(), torch.linalg.inv(Lam), rtol=1e-8, atol=1e-10)
    draws = prod.sample(40000, torch.Generator().manual_seed(0))
    assert (draws.mean(0) - mean).abs().max() < 5 * math.sqrt(torch.linalg.inv(Lam).diagonal().max() / 40000)
    emp = torch.cov(draws.T)
    assert (emp - torch.linalg.inv(Lam)).abs().max() < 0.05 * torch.linalg.inv(Lam).abs().max()


def test_swag_product_refuses_a_non_positive_definite_result():
    gen = torch.Generator().manual_seed(0)
    moments = [_moments(10, 3, gen) for _ in range(3)]
    with pytest.raises(MethodNotApplicableError, match="not positive definite"):
        multiply(moments, [1e4] * 3, 1.0)  # subtracting 2·10⁴ leaves a negative precision


def test_swag_product_method_on_fitted_clients(tmp_path, small_silo):
    from conftest import fit_artifact

    import posterior_fusion
    from posterior_fusion.data.silo import SiloData
    from posterior_fusion.fusion import FusionInputs, FusionOptions, method_settings
    from posterior_fusion.fusion.registry import get_method

    paths = []
    for c in range(2):
        paths.append(tmp_path / f"s{c}.h5")
        fit_artifact(paths[-1], SiloData(small_silo.x[c * 100 : (c + 1) * 100], small_silo.y[c * 100 : (c + 1) * 100],
                                         "fmnist", 10), "diag", mixtures=1, epochs=4, seed=c, swag=True)
    clients = [posterior_fusion.load(p) for p in paths]
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    res = get_method("swag-product")(inputs, method_settings("swag-product", {}))
    moms = [c.components[0].swag for c in clients]
    lam = [inputs.prior_precision(c) for c in clients]
    want = multiply(moms, lam, inputs.server_prior_precision(), 1e-8).mean
    torch.testing.assert_close(res.members[0].double(), want, rtol=1e-5, atol=1e-6)
    res5 = get_method("swag-product")(inputs, method_settings("swag-product", {"num_samples": 5}))
    assert len(res5.members) == 5 and not torch.equal(res5.members[0], res5.members[1])
