"""Predictive distributions of a fused posterior: a mixture of Gaussians ``Σ_k π_k N(w*_k, Λ*_k⁻¹)``.

* ``map``: ``Σ_k π_k softmax(f(x; w*_k))`` (the ensemble of modes);
* ``mc``: ``Σ_k π_k (1/S) Σ_s softmax(f(x; w_ks))`` with ``w_ks ~ N(w*_k, Λ*_k⁻¹)``;
* ``glm``: the linearised model ``f(x; w) ≈ f(x; w*) + J(x)(w − w*)`` (Immer et al. 2021), whose
  logits are Gaussian with covariance ``J Λ*⁻¹ Jᵀ``; its softmax is approximated with the probit
  (``link="probit"``: ``softmax(f* / sqrt(1 + π/8 · diag(J Λ*⁻¹ Jᵀ)))``, laplace-torch's choice)
  or integrated by sampling the logits (``link="mc"``). ``J Λ*⁻¹ Jᵀ`` is built layer by layer
  (:func:`structured_moments`): the capture's backward passes give each layer's Jacobian from its
  inputs and output gradients, and each block of ``Λ*`` whitens its own parameters' part (a
  Kronecker block in its factors' eigenbases, without forming a per-sample Jacobian row for a
  linear layer); models with parameters outside Linear/Conv2d/normalisation layers fall back to
  per-sample full Jacobians (:func:`jacobian_moments`, the same numbers).
* ``glm-last-layer``: the same with only the last ``nn.Linear`` uncertain (laplace-torch's
  last-layer Laplace): its Jacobian is ``[e_c ⊗ φ(x), e_c]`` in closed form (φ: the layer's input),
  and ``Λ*``'s blocks over that layer are its marginal (``Λ*`` is block-diagonal), so the covariance
  costs one forward pass and a ``(C, C·F + C)`` product per sample — no per-sample full Jacobian.

``scale`` multiplies every posterior covariance (1 = the posterior; a value chosen on
validation data tempers the predictive). Shapes: ``x`` ``(n, ...)``, probabilities ``(n, classes)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from posterior_fusion import budget, ranges
from posterior_fusion.choices import LINKS, PREDICTIVES
from posterior_fusion.curvature import BlockDiag, CompressedKron, Diag, Kron, Precision
from posterior_fusion.errors import ConfigError
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.functional import batched_logits
from posterior_fusion.pooling import AVERAGE, Pooling
from posterior_fusion.runtime import release_freed_memory

if TYPE_CHECKING:
    from posterior_fusion.models.jacobians import FactoredJacobian



def _check(predictive: str, precisions, scale: float) -> None:
    if predictive not in PREDICTIVES:
        raise ConfigError(f"unknown predictive {predictive!r}; use one of {', '.join(PREDICTIVES)}")
    if predictive != "map" and precisions is None:
        raise ConfigError(f"predictive {predictive!r} needs a global posterior (fuse `method` fedbens stores one); "
                          "this artifact has only point estimates: use `predictive` map")
    ranges.check("scale", scale, ranges.PREDICTIVE_SCALE)


GLM_BYTES_PER_JACOBIAN_ENTRY = 48  # J (float32), its whitened float64 copy, the product's and vmap's work space


def eigenbasis_bytes(precisions: Sequence[Precision]) -> int:
    """What the mc and GLM predictives hold beyond the loaded precisions: for each compressed Kronecker
    block (stored as a few eigenpairs) its whole eigenbases and rebuilt factors, ``8·(out² + in²)`` bytes,
    which its draws and solves form; plain blocks are held dense already."""
    total = 0
    for precision in precisions:
        for block in getattr(precision, "blocks", [precision]):
            if isinstance(block, CompressedKron):
                out, inn = block.shape
                total += 8 * (out * out + inn * inn)
    return total


def glm_batch_size(num_classes: int, dim: int, max_memory: int | str | None = None, largest: int = 32) -> int:
    """Samples per batch of the GLM predictive so one batch's Jacobians fit in a quarter of the
    budget; refuses (one line) when even one sample does not fit."""
    return batch_within_budget(num_classes * dim * GLM_BYTES_PER_JACOBIAN_ENTRY, largest,
                               "the GLM predictive (the Jacobians of one sample)", max_memory)


def batch_within_budget(per_sample: int, largest: int, what: str, max_memory: int | str | None) -> int:
    """Samples per batch: ``largest``, or fewer so a batch of ``per_sample`` bytes each fits in a
    quarter of the memory budget; refuses (one line, naming ``what``) when one sample does not."""
    limit = budget.resolve_limit(max_memory)
    if limit is None:
        return largest
    budget.require(per_sample, what, limit // 4)
    return max(1, min(largest, limit // 4 // per_sample))


def logit_moments(spec: ModelSpec, w: torch.Tensor, precision: Precision, x: torch.Tensor, scale: float = 1.0,
                  batch_size: int | None = None,
                  max_memory: int | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Linearised logits at ``w`` ``(d,)``: mean ``(n, C)`` and covariance ``scale · J Λ⁻¹ Jᵀ`` ``(n, C, C)``,
    layer by layer from the precision's blocks (:func:`structured_moments`) where every parameter
    sits in a Linear/Conv2d/normalisation layer, else from per-sample full Jacobians
    (:func:`jacobian_moments`; the same numbers, slower and larger)."""
    from posterior_fusion.models.jacobians import jacobian_problem

    model = spec.build()
    if jacobian_problem(model.eval(), x[:1]) is None:
        return structured_moments(spec, w, precision, x, scale, batch_size, max_memory)
    return jacobian_moments(spec, w, precision, x, scale, batch_size, max_memory)


def units(precision: Precision, sizes: list[int]) -> list[tuple[int, int, BlockDiag]]:
    """The precision cut at parameter boundaries: ``(first parameter, end parameter, blocks)`` with
    ``blocks`` the precision over those parameters (``sizes``: each parameter's numel, in order). A
    diagonal block is cut at every parameter; any other block (Kronecker over one weight, dense over
    a bias or over a last layer's weight and bias) must cover whole parameters."""
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    where = {b: k for k, b in enumerate(bounds)}
    blocks = precision.blocks if isinstance(precision, BlockDiag) else (precision,)
    offsets = precision.offsets if isinstance(precision, BlockDiag) else (0,)
    out = []
    for b, off in zip(blocks, offsets):
        if off not in where or off + b.dim not in where:
            raise ConfigError(f"a {b.kind} block does not cover whole parameters")
        first, end = where[off], where[off + b.dim]
        if isinstance(b, Diag):
            out.extend((k, k + 1, restricted(precision, bounds[k], bounds[k + 1])) for k in range(first, end))
        else:
            out.append((first, end, b))
    return out


def _kron_covariance(block: Kron, J: FactoredJacobian) -> torch.Tensor:
    """``J Λ⁻¹ Jᵀ`` ``(M, C, C)`` (float64) of one Kronecker block ``Λ = s·B⊗A + δ`` from the factored
    Jacobian, no ``(O·I)`` row formed for a plain linear layer: in the factors' eigenbases
    ``ĝ = U_Bᵀ g``, ``û = U_Aᵀ u``, ``Z = Σ_s ĝ_s û_sᵀ`` and ``J_c Λ⁻¹ J_dᵀ = Σ_ij Z_c,ij Z_d,ij / λ_ij``;
    with one position it is ``Σ_i ĝ_ci ĝ_di Σ_j û_j² / λ_ij``. Products in the Jacobian's dtype
    (float32: batched GEMMs), the covariance summed in float64."""
    _, UB, _, UA = block.eigen()
    dt = J.g.dtype
    UB, UA = UB.to(dt), UA.to(dt)
    inv = block.eigenvalue_grid().double().reciprocal()  # (O, I)
    M, C, O, S = J.g.shape  # noqa: E741
    I = J.u.shape[1]  # noqa: E741
    if S == 1:
        g = (J.g.reshape(M * C, O) @ UB).reshape(M, C, O).double()
        weight = (J.u[:, :, 0] @ UA).double().square() @ inv.T  # (M, O)
        return torch.einsum("mco,mdo,mo->mcd", g, g, weight)
    if C * O * O * S + I * I * S <= C * (O * O * I + O * I * I):  # rotate g and u, then Z = Σ_s ĝ_s û_sᵀ
        g = (J.g.transpose(2, 3).reshape(-1, O) @ UB).reshape(M, C, S, O).transpose(2, 3).reshape(M, C * O, S)
        u = (J.u.transpose(1, 2).reshape(-1, I) @ UA).reshape(M, S, I)
        Z = torch.bmm(g, u).reshape(M, C, O, I) * inv.sqrt().to(dt)
    else:  # Z0 = Σ_s g_s u_sᵀ first, then rotate it: U_Bᵀ Z0 U_A (as its transpose)
        Z0 = torch.bmm(J.g.reshape(M, C * O, S), J.u.transpose(1, 2)).reshape(-1, I) @ UA  # (M·C·O, I)
        Zt = Z0.reshape(M * C, O, I).transpose(1, 2).reshape(-1, O) @ UB  # (M·C·I, O)
        Z = Zt.reshape(M, C, I, O) * inv.T.sqrt().to(dt)
    Z = Z.reshape(M, C, -1)
    return torch.bmm(Z, Z.transpose(1, 2)).double()


STRUCTURED_BATCH = 64  # samples per pass at most (larger batches were slower on 2 cores: benchmarks/glm_structured_bench.py)


def structured_batch_size(model: nn.Module, x: torch.Tensor, num_classes: int, largest_parameter: int,
                          max_memory: int | str | None = None) -> int:
    """Samples per pass of :func:`structured_moments`: at most :data:`STRUCTURED_BATCH`, and within a
    quarter of the memory budget for what one sample keeps: C output gradients of every layer
    (float32) beside the activations, and one parameter's Jacobian ``(C, numel)`` with its whitened
    float64 copy; refuses (one line) when one sample does not fit."""
    from posterior_fusion.models.jacobians import output_bytes

    per_sample = (num_classes + 2) * sum(output_bytes(model, x[:1])) + 12 * num_classes * largest_parameter
    return batch_within_budget(per_sample, STRUCTURED_BATCH, "the GLM predictive (one sample's layer Jacobians)",
                               max_memory)


def structured_moments(spec: ModelSpec, w: torch.Tensor, precision: Precision, x: torch.Tensor, scale: float = 1.0,
                       batch_size: int | None = None,
                       max_memory: int | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logit_moments` layer by layer: for a batch, one forward and C backward passes to the
    layer outputs give each parameter's Jacobian ``(b, C, numel)`` (``models/jacobians.logit_jacobians``);
    each block of ``Λ`` whitens its own parameters' Jacobians (a Kronecker block by its factors'
    eigenbases, no dense matrix) and ``J Λ⁻¹ Jᵀ = Σ_blocks (Λ_b^{-½} J_b)(Λ_b^{-½} J_b)ᵀ``, so one
    block's Jacobians are held at a time, never the ``(b, C, d)`` Jacobian."""
    from posterior_fusion.models.jacobians import FactoredJacobian, logit_jacobians

    model = spec.build()
    torch.nn.utils.vector_to_parameters(w.detach().clone().to(torch.float32), model.parameters())
    model.eval()
    sizes = [p.numel() for p in model.parameters()]
    parts = units(precision, sizes)
    C = spec.num_classes
    if batch_size is None:
        batch_size = structured_batch_size(model, x, C, max(sizes), max_memory)
    means, covs = [], []
    for i in range(0, x.shape[0], batch_size):
        xb = x[i: i + batch_size]
        cov = torch.zeros(len(xb), C, C, dtype=torch.float64)
        pending: dict[int, torch.Tensor] = {}
        todo = iter(parts)
        lo, hi, block = next(todo)
        for k, J in logit_jacobians(model, xb):
            if k < 0:  # the logits come first
                means.append(J.double())
                continue
            pending[k] = J
            while hi - 1 in pending:  # this unit's parameters are all here: whiten and add
                if isinstance(block, Kron) and hi - lo == 1 and isinstance(pending[lo], FactoredJacobian):
                    cov += _kron_covariance(block, pending.pop(lo))
                else:
                    Jb = torch.cat([_dense(pending.pop(j)) for j in range(lo, hi)], dim=2)
                    U = block.whiten(Jb.reshape(-1, Jb.shape[2]).to(block.dtype)).double().reshape(len(xb), C, -1)
                    cov += torch.einsum("bcd,bed->bce", U, U)
                    del Jb, U
                lo, hi, block = next(todo, (None, 0, None))
                if lo is None:
                    break
        covs.append(scale * cov)
    release_freed_memory()
    return torch.cat(means), torch.cat(covs)


def _dense(J) -> torch.Tensor:
    """A Jacobian from :func:`~posterior_fusion.models.jacobians.logit_jacobians` as ``(M, C, numel)``."""
    return J if isinstance(J, torch.Tensor) else J.dense()


def jacobian_moments(spec: ModelSpec, w: torch.Tensor, precision: Precision, x: torch.Tensor, scale: float = 1.0,
                     batch_size: int | None = None,
                     max_memory: int | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logit_moments` from per-sample full Jacobians ``(b, C, d)`` (``vmap(jacrev)``): any model.
    Batches are sized from the memory budget (:func:`glm_batch_size`) unless ``batch_size`` is given."""
    model = spec.build().eval()
    if batch_size is None:
        batch_size = glm_batch_size(spec.num_classes, w.numel(), max_memory)
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
            del J, U
        release_freed_memory()  # the Jacobians' buffers go back to the system: one batch at a time
    return torch.cat(means), torch.cat(covs)


def restricted(precision: Precision, start: int, stop: int) -> BlockDiag:
    """The blocks of a block-diagonal ``precision`` over the parameters ``[start, stop)`` (a diagonal
    block reaching past the range is sliced; any other block must lie inside it or outside it)."""
    blocks = precision.blocks if isinstance(precision, BlockDiag) else (precision,)
    offsets = precision.offsets if isinstance(precision, BlockDiag) else (0,)
    parts = []
    for b, off in zip(blocks, offsets):
        lo, hi = max(start, off), min(stop, off + b.dim)
        if lo >= hi:
            continue
        if (lo, hi) == (off, off + b.dim):
            parts.append(b)
        elif isinstance(b, Diag):
            parts.append(Diag(b.g[lo - off : hi - off], b.scale, b.shift))
        else:
            raise ConfigError(f"a {b.kind} block covers parameters on both sides of the last layer's; "
                              "the last-layer predictive needs the layer's own blocks")
    return BlockDiag(parts, precision.scale, [b.shift for b in parts])


def last_layer_moments(spec: ModelSpec, w: torch.Tensor, precision: Precision, x: torch.Tensor, scale: float = 1.0,
                       batch_size: int | None = None,
                       max_memory: int | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logit mean ``(n, C)`` and covariance ``scale · J Λ_ll⁻¹ Jᵀ`` ``(n, C, C)`` with only the last
    ``nn.Linear`` uncertain: ``J = [e_c ⊗ φ, e_c]`` (weight row-major, then bias) and ``Λ_ll`` the
    blocks of ``precision`` over that layer. Batches are sized from the memory budget (as
    :func:`logit_moments`, for the last layer's Jacobians) unless ``batch_size`` is given. A Kronecker
    block over the layer's weight uses its factors (:func:`_kron_covariance`: no Jacobian row formed);
    any other block whitens the Jacobian's columns it covers."""
    from posterior_fusion.models.jacobians import FactoredJacobian

    model = spec.build()
    torch.nn.utils.vector_to_parameters(w.detach().clone().to(torch.float32), model.parameters())
    model.eval()
    named = list(model.named_parameters())
    last_name = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not last_name:
        raise ConfigError(f"model {spec.name!r} has no nn.Linear: the last-layer predictive needs one")
    last = dict(model.named_modules())[last_name[-1]]
    offsets, total = {}, 0
    for n, p in named:
        offsets[n] = (total, p.numel())
        total += p.numel()
    prefix = f"{last_name[-1]}." if last_name[-1] else ""
    start = offsets[prefix + "weight"][0]
    C, F = last.weight.shape
    size = C * F + (C if last.bias is not None else 0)
    if last.bias is not None and offsets[prefix + "bias"][0] != start + C * F:
        raise ConfigError("the last layer's weight and bias are not adjacent in the parameter vector")
    prec = restricted(precision, start, start + size)
    if batch_size is None:
        batch_size = glm_batch_size(C, size, max_memory, largest=STRUCTURED_BATCH)
    feats: list[torch.Tensor] = []
    handle = last.register_forward_hook(lambda m, i, o: feats.append(i[0].detach()))
    means, covs = [], []
    try:
        with torch.no_grad():
            for i in range(0, x.shape[0], batch_size):
                feats.clear()
                logits = model(x[i : i + batch_size]).double()
                phi = feats[0].reshape(logits.shape[0], -1)  # (b, F)
                cov = torch.zeros(len(phi), C, C, dtype=torch.float64)
                for block, off in zip(prec.blocks, prec.offsets):
                    if isinstance(block, Kron) and (off, block.dim) == (0, C * F):  # the weight: factored, no J row
                        g = torch.eye(C, dtype=phi.dtype).expand(len(phi), C, C)[..., None]  # (b, C, O = C, 1)
                        cov += _kron_covariance(block, FactoredJacobian(g, phi[:, :, None]))
                        continue
                    cols = torch.arange(off, off + block.dim)  # J = [e_c ⊗ φ, e_c] over this block's columns
                    weight_cols, bias_cols = cols[cols < C * F], cols[cols >= C * F] - C * F
                    J = torch.zeros(len(phi), C, block.dim, dtype=torch.float64)
                    rows, feat = weight_cols // F, weight_cols % F
                    J[:, rows, torch.arange(len(weight_cols))] = phi.double()[:, feat]
                    J[:, bias_cols, len(weight_cols) + torch.arange(len(bias_cols))] = 1.0
                    U = block.whiten(J.reshape(-1, block.dim).to(block.dtype)).double().reshape(len(phi), C, -1)
                    cov += torch.einsum("bcd,bed->bce", U, U)
                covs.append(scale * cov)
                means.append(logits)
    finally:
        handle.remove()
    return torch.cat(means), torch.cat(covs)


LOGIT_MOMENTS = {"glm": logit_moments, "glm-last-layer": last_layer_moments}
"""The linearised predictives: their logits' mean and covariance ``(spec, w, Λ, x, scale)``."""


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
            scale: float = 1.0, link: str = "probit", seed: int = 0,
            max_memory: int | str | None = None, pooling: Pooling = AVERAGE) -> torch.Tensor:
    """Predictive class probabilities ``(n, classes)`` of the mixture over modes (see module doc).

    ``precisions[k]`` is ``Λ*_k`` (a :class:`Precision`, not raw curvature); ``weights`` the
    mode weights ``π`` (default uniform); ``pooling`` how the members' predictions combine
    (:mod:`posterior_fusion.pooling`; default the π-weighted average)."""
    _check(predictive, precisions, scale)
    if link not in LINKS:
        raise ConfigError(f"unknown link {link!r}; use one of {', '.join(LINKS)}")
    ranges.check("samples", samples, ranges.SAMPLES)
    if predictive != "map" and precisions is not None:
        budget.require(eigenbasis_bytes(precisions), f"the {predictive} predictive (the posterior's eigenbases)",
                       max_memory)
    K = len(members)
    pi = torch.full((K,), 1.0 / K, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)

    def member_probs():
        for k, w in enumerate(members):
            if predictive == "map":
                yield torch.softmax(batched_logits(spec, w[None], x)[0].double(), -1)
            elif predictive == "mc":
                W = w.double() + math.sqrt(scale) * precisions[k].sample(samples, gen).double()
                yield torch.softmax(batched_logits(spec, W, x).double(), -1).mean(0)
            else:
                mean, cov = LOGIT_MOMENTS[predictive](spec, w, precisions[k], x, scale, max_memory=max_memory)
                yield probit(mean, cov) if link == "probit" else sampled_link(mean, cov, samples, gen)

    return pooling.combine(member_probs(), pi).float()
