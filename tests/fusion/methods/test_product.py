"""The Gaussian product (fusion/methods/product.py) against the pooled posterior."""

from __future__ import annotations

import torch
from conftest import linear_gaussian_clients

import posterior_fusion
from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionInputs,
    FusionOptions,
    fuse,
)

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


def test_product_recovers_pooled_posterior():
    clients, mu, _ = linear_gaussian_clients()
    res = product(FusionInputs(clients, FusionOptions()))
    torch.testing.assert_close(res.members[0].double(), mu, rtol=1e-5, atol=1e-5)


def test_product_on_real_diag_artifact_runs(fitted):
    folder, _ = fitted
    _, res, _ = fuse([folder / "diag_0.h5"], "product")
    # One client: product of its posterior with nothing else is its own Gaussian's mean, the MAP.
    art = posterior_fusion.load(folder / "diag_0.h5")
    torch.testing.assert_close(res.members[0], art.components[0].map, rtol=1e-5, atol=1e-6)
