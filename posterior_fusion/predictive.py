"""Predictive distributions of a fused posterior: a mixture of Gaussians ``Σ_k π_k N(w*_k, Λ*_k⁻¹)``.

* ``map``: ``Σ_k π_k softmax(f(x; w*_k))`` (the ensemble of modes);
* ``mc``: ``Σ_k π_k (1/S) Σ_s softmax(f(x; w_ks))`` with ``w_ks ~ N(w*_k, Λ*_k⁻¹)``;
* ``glm``: the linearised model ``f(x; w) ≈ f(x; w*) + J(x)(w − w*)`` (Immer et al. 2021), whose
  logits are Gaussian with covariance ``J Λ*⁻¹ Jᵀ``; its softmax is approximated with the probit
  (``link="probit"``: ``softmax(f* / sqrt(1 + π/8 · diag(J Λ*⁻¹ Jᵀ)))``, laplace-torch's choice)
  or integrated by sampling the logits (``link="mc"``).

``scale`` multiplies every posterior covariance (1 = the posterior; a value chosen on
validation data tempers the predictive). Shapes: ``x`` ``(n, ...)``, probabilities ``(n, classes)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.func import functional_call, jacrev, vmap

from posterior_fusion.curvature import Precision
from posterior_fusion.errors import ConfigError
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.functional import batched_logits

PREDICTIVES = ("map", "mc", "glm")
LINKS = ("probit", "mc")


def _check(predictive: str, precisions, scale: float) -> None:
    if predictive not in PREDICTIVES:
        raise ConfigError(f"unknown predictive {predictive!r}; use one of {', '.join(PREDICTIVES)}")
    if predictive != "map" and precisions is None:
        raise ConfigError(f"predictive {predictive!r} needs a global posterior (fuse --method fedbens stores one); "
                          "this artifact has only point estimates: use --predictive map")
    if not scale > 0:
        raise ConfigError("the predictive covariance scale must be > 0")


def logit_moments(spec: ModelSpec, w: torch.Tensor, precision: Precision, x: torch.Tensor, scale: float = 1.0,
                  batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Linearised logits at ``w`` ``(d,)``: mean ``(n, C)`` and covariance ``scale · J Λ⁻¹ Jᵀ`` ``(n, C, C)``."""
    model = spec.build()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [math.prod(s) for s in shapes]

    def f(flat: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(flat, sizes), shapes)}
        out = functional_call(model, params, (xb[None],))[0]
        return out, out.detach()  # (differentiated, aux: the logits themselves)

    w = w.detach().float()
    means, covs = [], []
    for i in range(0, x.shape[0], batch_size):
        xb = x[i : i + batch_size]
        with torch.no_grad():
            J, logits = vmap(jacrev(f, has_aux=True), in_dims=(None, 0))(w, xb)  # (b, C, d), (b, C)
            b, C, d = J.shape
            U = precision.whiten(J.reshape(b * C, d).to(precision.dtype)).to(torch.float64).reshape(b, C, d)
            covs.append(scale * torch.einsum("bcd,bed->bce", U, U))  # J Λ⁻¹ Jᵀ
            means.append(logits.double())
    return torch.cat(means), torch.cat(covs)


def probit(mean: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Probit approximation of ``E[softmax(f)]``, ``f ~ N(mean, cov)``: ``softmax(mean / sqrt(1 + π/8 · diag cov))``."""
    var = torch.diagonal(cov, dim1=-2, dim2=-1)
    return torch.softmax(mean / torch.sqrt(1 + math.pi / 8 * var), dim=-1)


def sampled_link(mean: torch.Tensor, cov: torch.Tensor, samples: int, generator: torch.Generator | None) -> torch.Tensor:
    """Monte-Carlo ``E[softmax(f)]`` with ``f ~ N(mean, cov)`` (full ``C × C`` covariance)."""
    C = mean.shape[-1]
    L = torch.linalg.cholesky(cov + 1e-10 * torch.eye(C, dtype=cov.dtype) * (1 + cov.diagonal(dim1=-2, dim2=-1).mean()))
    eps = torch.randn(samples, *mean.shape, generator=generator, dtype=mean.dtype)
    f = mean[None] + torch.einsum("nce,sne->snc", L, eps)
    return torch.softmax(f, dim=-1).mean(0)


def predict(spec: ModelSpec, members: Sequence[torch.Tensor], x: torch.Tensor, predictive: str = "map",
            precisions: Sequence[Precision] | None = None, weights: torch.Tensor | None = None, samples: int = 30,
            scale: float = 1.0, link: str = "probit", seed: int = 0) -> torch.Tensor:
    """Predictive class probabilities ``(n, classes)`` of the mixture over modes (see module doc).

    ``precisions[k]`` is ``Λ*_k`` (a :class:`Precision`, not raw curvature); ``weights`` the
    mode weights ``π`` (default uniform)."""
    _check(predictive, precisions, scale)
    if link not in LINKS:
        raise ConfigError(f"unknown link {link!r}; use one of {', '.join(LINKS)}")
    if samples < 1:
        raise ConfigError("--samples must be >= 1")
    K = len(members)
    pi = torch.full((K,), 1.0 / K, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(x.shape[0], spec.num_classes, dtype=torch.float64)
    for k, w in enumerate(members):
        if predictive == "map":
            p = torch.softmax(batched_logits(spec, w[None], x)[0].double(), -1)
        elif predictive == "mc":
            W = w.double() + math.sqrt(scale) * precisions[k].sample(samples, gen).double()
            p = torch.softmax(batched_logits(spec, W, x).double(), -1).mean(0)
        else:
            mean, cov = logit_moments(spec, w, precisions[k], x, scale)
            p = probit(mean, cov) if link == "probit" else sampled_link(mean, cov, samples, gen)
        out += pi[k] * p
    return out.float()
