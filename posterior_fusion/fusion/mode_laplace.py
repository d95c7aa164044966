"""A Laplace approximation of the global posterior at each fused mode.

At a mode ``w*`` of ``log p(w | D) = Σ_c [log q_c(w) − log p0_c(w)] + log p0(w)``,

    −∇² log q_c(w*) = Σ_m r_cm Λ_cm − ( Σ_m r_cm g_cm g_cmᵀ − ḡ_c ḡ_cᵀ ),   g_cm = Λ_cm (w* − ŵ_cm),

with responsibilities ``r_cm = softmax_m(log π_cm + ½ log|Λ_cm| − ½ q_cm(w*))``. We keep the
first term and drop the mixture's covariance term (a Gauss–Newton-style choice: it vanishes
when one component per client dominates, as it does at the modes in practice, and keeping it
could make the precision indefinite). With ``Λ_cm = s_c G_cm + λ_c I`` and ``Σ_m r_cm = 1``:

    Λ* = Σ_c Σ_m r_cm s_c G_cm  +  λ0 I.

Each block position is combined by its class (``Precision.weighted_sum``): exact for diagonal
and dense blocks; for Kronecker blocks the Frobenius-nearest Kronecker product of the weighted
sum, whose relative error is recorded per layer (see ``docs/maths.md``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.curvature import BLOCK_TYPES, BlockDiag
from posterior_fusion.mixture import LOG_2PI
from posterior_fusion.progress import progress
from posterior_fusion.runtime import release_freed_memory


def responsibilities(clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                     W: torch.Tensor) -> list[torch.Tensor]:
    """Per client, ``(K, M_c)`` component responsibilities at the K points ``W`` ``(K, d)``: the softmax of
    :func:`component_log_densities`."""
    return [torch.softmax(log_comp, dim=-1)
            for log_comp in component_log_densities(clients, temperatures, prior_precisions, W)]


def component_log_densities(clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                            W: torch.Tensor) -> list[torch.Tensor]:
    """Per client, ``(K, M_c)``: ``log π_cm + ½ log|Λ_cm| − ½ (w − ŵ_cm)ᵀ Λ_cm (w − ŵ_cm)`` at the K points
    ``W`` ``(K, d)`` (the component log-densities up to −d/2 log 2π), in float64 one block at a time
    (from the blocks' cached decompositions: no float64 copy of every factor)."""
    out = []
    W = W.detach().double()
    for c, t, lam in zip(clients, temperatures, prior_precisions):
        cols = []
        for comp in c.components:
            prec = comp.curvature.precision(t, lam)  # shares the client blocks' cached decompositions
            # log|Λ| in float64 from those decompositions (computed once per block over all calls)
            cols.append(0.5 * prec.logdet() - 0.5 * quadratic_form64(prec, W - comp.map.double()))
        out.append(torch.log(c.weights.double())[None] + torch.stack(cols, dim=1))
        release_freed_memory()  # the blocks' float64 copies (of every size): not kept between clients
    return out


def quadratic_form64(precision: BlockDiag, V: torch.Tensor) -> torch.Tensor:
    """``vᵀ Λ v`` for the rows of ``V`` ``(..., d)`` float64, in float64 with one block converted at a time
    (a float32 artifact's curvature is never copied to float64 whole)."""
    return sum(b.astype(torch.float64).quadratic_form(V[..., off : off + b.dim])
               for b, off in zip(precision.blocks, precision.offsets))


def negative_log_posterior(clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                           server_prior_precision: float | Sequence[float], W: torch.Tensor,
                           centres: torch.Tensor | None = None) -> torch.Tensor:
    """``(K,)`` float64: fedbens' objective ``−log p(w | D)`` at the K points ``W`` ``(K, d)``, with the
    same constant as :class:`~posterior_fusion.fusion.methods.fedbens.GlobalLogPosterior` (normalised
    components, the prior correction's ``½ Σ_j d_j [Σ_c log λ_c − log λ0_j − (C − 1) log 2π]``), the
    over-counted prior divided out at row k of ``centres`` ``(K, d)`` (default zero); ``server_prior_precision``
    one λ0 or one per curvature block. From the blocks one at a time (:func:`component_log_densities`): no
    stacked copy of the clients' curvature, so a solver that never built one (EM) does not build it to
    report the objective at its modes."""
    W = W.detach().double()
    d = W.shape[1]
    lse = sum(torch.logsumexp(g, dim=1) for g in component_log_densities(clients, temperatures, prior_precisions, W))
    lse = lse - len(clients) * 0.5 * d * LOG_2PI  # each client's normalised mixture
    dims = [b.dim for b in clients[0].components[0].curvature.blocks]
    lam0 = per_block(server_prior_precision, len(dims))
    log_lams, lam_sum, C = sum(math.log(lam) for lam in prior_precisions), math.fsum(prior_precisions), len(clients)
    const = 0.5 * sum(dj * (log_lams - math.log(lj) - (C - 1) * LOG_2PI) for dj, lj in zip(dims, lam0))
    excess = per_coordinate([lam_sum - lj for lj in lam0], dims)
    off = W if centres is None else W - centres.double()
    return -0.5 * (excess * off.square()).sum(1) + const - lse


def per_block(value: float | Sequence[float], blocks: int) -> list[float]:
    """One number per curvature block from one number or a per-block sequence."""
    return [float(v) for v in value] if isinstance(value, Sequence) else [float(value)] * blocks


def per_coordinate(values: Sequence[float], dims: Sequence[int]) -> torch.Tensor:
    """``(Σ dims,)`` float64: block j's number repeated over its ``dims[j]`` coordinates."""
    return torch.cat([torch.full((n,), float(v), dtype=torch.float64) for v, n in zip(values, dims)])


def mode_precisions(clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                    server_prior_precision: float, W: torch.Tensor,
                    show_progress: bool = True) -> tuple[list[BlockDiag], list[list[float]]]:
    """Raw curvature ``Σ_c Σ_m r_cm s_c G_cm`` at each row of ``W`` (a BlockDiag;
    ``.precision(1, λ0)`` is ``Λ*``), and per mode the relative Frobenius error of each block's
    representation (0 = exact)."""
    resp = responsibilities(clients, temperatures, prior_precisions, W)
    ref = clients[0].components[0].curvature
    # (K, N): the weight r_cm / T_c of every client component at every mode
    weights = torch.cat([r.double() / t for r, t in zip(resp, temperatures)], dim=1)
    blocks_per_comp = [comp.curvature.blocks for c in clients for comp in c.components]
    per_block = []  # per block position, K (block, error) pairs: one call shares the work of the K modes
    for j, proto in enumerate(progress(ref.blocks, "Laplace at the modes", len(ref.blocks), show=show_progress)):
        per_block.append(BLOCK_TYPES[proto.kind].weighted_sums([bs[j] for bs in blocks_per_comp], weights))
    precisions = [BlockDiag([pb[k][0] for pb in per_block]) for k in range(W.shape[0])]
    errors = [[pb[k][1] for pb in per_block] for k in range(W.shape[0])]
    return precisions, errors


def laplace_mode_weights(objective_values: torch.Tensor, precisions: list[BlockDiag]) -> torch.Tensor:
    """Mixture weights of the modes from the Laplace evidence: ``π_k ∝ p(w*_k | D) |Λ*_k|^{-1/2}``,
    i.e. ``softmax(−objective_k − ½ log|Λ*_k|)`` (constants shared by all modes cancel)."""
    logdets = torch.stack([p.logdet().double() for p in precisions])
    logits = -objective_values.double() - 0.5 * logdets
    if not torch.isfinite(logits).all():
        return torch.full((len(precisions),), 1.0 / len(precisions), dtype=torch.float64)
    return torch.softmax(logits, dim=0)


EVIDENCE_RANGE = (1e-8, 1e8)  # the prior precisions the evidence is maximised over
_GOLDEN = (math.sqrt(5) - 1) / 2


def _spectrum(curvature: BlockDiag) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per block of a raw curvature, what its eigenvalues are made of (float64): ``(b, a)`` for a
    Kronecker block (eigenvalues ``scale · b aᵀ``, factors' eigenvalues only: ``out + in`` numbers), else
    ``(λ, None)`` with the block's ``dim`` eigenvalues."""
    return [block.spectrum() for block in curvature.blocks]


def _log_evidence_terms(sq_norms: list[list[float]], spectra: list, sizes: list[int], scales: list[float],
                        delta: float) -> float:
    """``Σ_k Σ_j [−½ δ_j ‖w*_kj‖² + ½ d_j log δ_j − ½ Σ_i log(λ_kji + δ_j)]``, ``δ_j = δ c_j``, from the modes'
    squared norms per block and the blocks' spectra."""
    total = 0.0
    for sq, spectrum in zip(sq_norms, spectra):
        for sq_j, (b, a), n, c in zip(sq, spectrum, sizes, scales):
            if c == 0:  # a block whose prior δ does not scale: a constant
                continue
            dj = delta * c
            logdet = float(torch.log((torch.outer(b, a) if a is not None else b) + dj).sum())
            total += -0.5 * dj * sq_j + 0.5 * n * math.log(dj) - 0.5 * logdet
    return total


def evidence_prior_precision(members: list[torch.Tensor], curvatures: list[BlockDiag], tol: float = 1e-7,
                             block_scales: Sequence[float] | None = None) -> tuple[float, float]:
    """The prior precision δ of a prior ``N(0, δ⁻¹ I)`` that maximises the modes' summed Laplace evidence,
    and that maximum of its δ-dependent part ``Σ_k [−½ δ ‖w*_k‖² + ½ d log δ − ½ log|G_k + δ I|]``
    (``log p(D | δ) ≈ log p(D | w*_k) − ½ δ ‖w*_k‖² − ½ log(|G_k + δ I| / δ^d) + const``: MacKay's empirical
    Bayes with the modes — and so the data fit — held fixed, as laplace-torch's post-hoc prior tuning
    holds them). ``members`` ``(d,)`` each; ``curvatures`` the raw ``G_k``.

    Each term is strictly concave in δ (its derivative ``½ (γ(δ)/δ − ‖w*‖²)``, ``γ = Σ_i λ_i / (λ_i + δ)``
    over G's eigenvalues, decreases), so a golden-section search over ``log δ`` in
    :data:`EVIDENCE_RANGE` finds the one maximum to a relative ``tol``; at the optimum
    ``δ = Σ_k γ_k / Σ_k ‖w*_k‖²`` (the effective number of parameters over the modes' squared norm).
    Only eigenvalues are kept (a Kronecker block's factors' ones, from the blocks' caches); each
    evaluation is one float64 pass over them.

    ``block_scales`` ``c_j ≥ 0`` (one per block): the prior is ``N(0, diag(δ c_j I))`` instead, block j's
    precision ``δ c_j``, and δ is the scale factor maximising the same evidence (at the optimum
    ``δ = Σ_k γ_k / Σ_k Σ_j c_j ‖w*_kj‖²``; a block with ``c_j = 0`` is left out)."""
    blocks = len(curvatures[0].blocks)
    scales = [1.0] * blocks if block_scales is None else [float(c) for c in block_scales]
    spectra = [_spectrum(c) for c in curvatures]
    offsets = curvatures[0].offsets
    sizes = [b.dim for b in curvatures[0].blocks]
    sq_norms = [[float(w[o: o + n].double().square().sum()) for o, n in zip(offsets, sizes)] for w in members]

    def f(t: float) -> float:
        return _log_evidence_terms(sq_norms, spectra, sizes, scales, math.exp(t))

    lo, hi = math.log(EVIDENCE_RANGE[0]), math.log(EVIDENCE_RANGE[1])
    a, b = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    fa, fb = f(a), f(b)
    while hi - lo > tol:
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + _GOLDEN * (hi - lo)
            fb = f(b)
        else:
            hi, b, fb = b, a, fa
            a = hi - _GOLDEN * (hi - lo)
            fa = f(a)
    t = 0.5 * (lo + hi)
    return math.exp(t), f(t)
