"""FedBEns (Talpini et al.): modes of the product of client mixtures over the over-counted prior.

    log p(w | D) = Σ_c [ log q_c(w) − log p0_c(w) ] + log p0(w) + const
    q_c(w) = Σ_m π_cm N(w; ŵ_cm, Λ_cm⁻¹),   Λ_cm = G_cm / T_c + λ0_c I

Dividing the prior N(0, λ⁻¹ I) out C − 1 times is exact for exact client posteriors, but a Laplace
component says N(ŵ_cm, λ_c⁻¹) along directions its curvature does not see, where the true posterior
is the prior N(0, λ_c⁻¹): there the product's mean is Σ_c λ_c ŵ_cm / λ0 ≈ C times the clients'
weights (``docs/results/fusion_safety/README.md``). ``prior_centre = "clients"`` divides the
over-counted prior out at μ_m = Σ_c λ_c ŵ_cm / Σ_c λ_c instead (per mode, from the component index
it starts from): the quadratic term, the precision and the Laplace step are unchanged, and along a
direction no client's curvature sees the mode is μ_m, the clients' average.

With validation data the server runs, by default (``solver = "auto"``), the paper's protocol: one Adam
optimisation per mode index m, started at the element-wise median over clients of ŵ_cm, keeping the
best validation iterate. The M runs are batched: the parameters are a ``(M, d)`` tensor with per-row
gradient clipping, which is the same as M independent Adam runs. Without validation data the default is
the stationary, validation-free fusion instead (:func:`resolve_auto`): EM to a stationary point with the
prior centre at the clients and the server prior from the evidence — Adam's best-objective iterate is
what early stopping would otherwise have to rescue.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from posterior_fusion import ranges
from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.errors import ConfigError, IncompatibleArtifactsError
from posterior_fusion.fusion.em import MixtureProduct, em_modes
from posterior_fusion.fusion.mode_laplace import (
    EVIDENCE_RANGE,
    evidence_prior_precision,
    laplace_mode_weights,
    mode_precisions,
    negative_log_posterior,
)
from posterior_fusion.fusion.optimise import OptimiserSettings, optimise_modes
from posterior_fusion.fusion.settings import setting
from posterior_fusion.fusion.stack import StackedGaussians
from posterior_fusion.fusion.stacked import CHUNK_BYTES, default_chunk_bytes
from posterior_fusion.fusion.types import FusionInputs, FusionMethod, FusionResult, require_equal_components
from posterior_fusion.kernels.graphs import GraphedStep
from posterior_fusion.mixture import LOG_2PI, gaussian_log_norm
from posterior_fusion.progress import progress


@dataclass(frozen=True)
class FedBEnsSettings(OptimiserSettings):
    """FedBEns: Adam settings plus the number of global modes and the low-rank shortcut."""

    modes: int | None = setting(None, "Number of global modes; None = the clients' M.", bounds=ranges.COMPONENTS)
    laplace: bool = setting(True, "Store a Laplace approximation of the global posterior at each mode "
                                  "(enables evaluate --predictive mc|glm).")
    laplace_prior: str = setting("server", "Prior precision of the Laplace approximation at the modes (what mc/glm "
                                           "predict with): 'server' (λ0 = 1/prior_var, the objective's) or 'evidence' "
                                           "(the δ maximising the modes' Laplace evidence with the modes held fixed, "
                                           "MacKay's empirical Bayes: no data needed; recorded in the artifact).")
    mode_weights: str = setting("equal", "Mixture weights of the modes: 'equal', or 'laplace' (∝ p(w*|D) |Λ*|^-1/2).")
    allow_different_inits: bool = setting(False, "Fuse clients whose starting points differ (their m-th components "
                                                 "then need not be near each other; the per-mode median start is then meaningless).")
    lowrank_tol: float = setting(0.0, "Kronecker low-rank shortcut: drop eigen-directions with curvature < tol·λ0 "
                                      "(relative objective error < tol); 0 = exact.", bounds=(0, 1))
    starts: str = setting("median", "Where the global modes start: 'median' (per component index, the paper), "
                                    "'clients' (every client component's MAP: C·M modes) or 'median+clients'.")
    solver: str = setting("auto", "auto: 'em' with the validation-free prior (prior_centre and server_prior 'auto' "
                                  "become 'clients' and 'evidence') when the server has no validation data (--val) and "
                                  "the curvature is kron, or when server_prior=evidence or trust_radius asks for EM; "
                                  "else 'adam' (diag and diag+full: Adam's early iterates predict better there); adam: the "
                                  "paper's Adam, best validation iterate (else the best objective, which under strong "
                                  "heterogeneity predicts far worse); em: EM with exact per-layer solves to a stationary "
                                  "point (steps = iterations at most; no step size, no early stopping, no use of "
                                  "validation data).")
    damping: float = setting(0.0, "Tikhonov damping d of every client's curvature at per-sample scale: a Kronecker "
                                  "block (B + n·d·I) ⊗ (A + d·I), any other block + n·d on its diagonal (K-FAC's "
                                  "factored damping; FedLPA's d = 0.0316); 0 = the curvature as captured.",
                             bounds=(0, 1e6))
    trust_radius: float = setting(0.0, "solver=em only: keep each mode within ½(w−s)ᵀΛ̄(w−s)/N ≤ trust_radius of its "
                                       "start s, in the clients' own metric Λ̄ (their precisions, weighted by the "
                                       "responsibilities at s): the clients' quadratics predict at most this many nats "
                                       "per sample of extra loss anywhere inside; 0 = no region.", bounds=(0, 1e6))

    prior_centre: str = setting("auto", "Where the over-counted prior is divided out: 'zero' (the paper: N(0, λ⁻¹) "
                                        "C − 1 times, which multiplies the weights by C along directions no client's "
                                        "curvature sees), 'clients' (at each mode's λ-weighted client average of the "
                                        "MAPs of its component index: those directions keep the clients' average) or "
                                        "'auto' ('clients' when solver=auto runs EM, else 'zero').")
    server_prior: str = setting("auto", "The server prior's precision, how hard the modes are pulled to the prior "
                                        "centre: 'auto' ('evidence' when solver=auto runs EM, else 'clients'), "
                                        "'clients' (one λ0, the median of the clients' or 1/--prior-var) or "
                                           "'evidence' (solver=em only: one λ0 per curvature block, ρ × the block's "
                                           "curvature per parameter, ρ maximising the Laplace evidence of the server's "
                                           "model with the clients' likelihoods held fixed — MacKay's empirical Bayes, "
                                           "no data needed; EM re-solved until ρ moves by < 1 %; recorded in the artifact).")

    def validate(self) -> None:
        super().validate()
        if self.prior_centre not in PRIOR_CENTRES:
            raise ConfigError(f"setting prior_centre must be one of {PRIOR_CENTRES}")
        if self.trust_radius > 0 and self.solver == "adam":
            raise ConfigError("setting trust_radius needs solver=em")
        if self.server_prior not in SERVER_PRIORS:
            raise ConfigError(f"setting server_prior must be one of {SERVER_PRIORS}")
        if self.server_prior == "evidence" and self.solver == "adam":
            raise ConfigError("setting server_prior=evidence needs solver=em (the evidence is taken at stationary points)")
        if self.modes is not None and self.modes < 1:
            raise ConfigError("setting modes must be >= 1")
        if not 0 <= self.lowrank_tol < 1:
            raise ConfigError("setting lowrank_tol must be in [0, 1)")
        if self.laplace_prior not in LAPLACE_PRIORS:
            raise ConfigError(f"setting laplace_prior must be one of {LAPLACE_PRIORS}")
        if self.laplace_prior != "server" and not self.laplace:
            raise ConfigError("setting laplace_prior=evidence needs laplace=true")
        if self.mode_weights not in ("equal", "laplace"):
            raise ConfigError("setting mode_weights must be 'equal' or 'laplace'")
        if self.mode_weights == "laplace" and not self.laplace:
            raise ConfigError("setting mode_weights=laplace needs laplace=true")
        if self.starts not in STARTS:
            raise ConfigError(f"setting starts must be one of {STARTS}")
        if self.solver not in SOLVERS:
            raise ConfigError(f"setting solver must be one of {SOLVERS}")


class GlobalLogPosterior:
    """Negative global log posterior ``−log p(w | D)`` (up to a constant) for ``W`` ``(K, d)``.

    Clients are evaluated in chunks of whole clients whose working set (about ``3·K·d`` numbers
    per component) stays under ``chunk_bytes`` (default: the device's
    :func:`~posterior_fusion.fusion.stacked.default_chunk_bytes`, 64 MiB on a CPU; 0 = every client at
    once). Each chunk's log-sum-exp and its gradient are computed before the next chunk starts and
    only the ``(K, d)`` gradient is kept for the backward pass, so peak memory does not grow with the
    number of clients and no product is computed twice (autograd through the whole sum would keep
    every component's ``B V A`` until the backward pass). On CUDA, ``cuda_graphs`` (default on)
    replays each step with a gradient from a captured CUDA graph.

    ``prior_centres`` ``(K, d)``: the over-counted prior is divided out at row k's centre
    (``−½ (Σ λ_c − λ0) ‖w_k − μ_k‖²``) instead of at zero; the objective is then evaluated on
    exactly K rows, row k against μ_k."""

    def __init__(self, clients: list[ClientPosterior], temperatures: list[float], prior_precisions: list[float],
                 server_prior_precision: float, dtype: torch.dtype = torch.float32, lowrank_tol: float = 0.0,
                 kernel: str | None = None, device: str = "cpu", chunk_bytes: int | None = None,
                 cuda_graphs: bool = True, show_progress: bool = True,
                 prior_centres: torch.Tensor | None = None) -> None:
        comps, scales, shifts, self.groups = [], [], [], []
        for c, t, lam in zip(clients, temperatures, prior_precisions):
            start = len(comps)
            comps.extend(c.components)
            scales.extend([1.0 / t] * c.num_components)
            shifts.extend([lam] * c.num_components)
            self.groups.append((start, len(comps)))
        self.stack = StackedGaussians(comps, scales, shifts, dtype, lowrank_tol, kernel, show_progress).to(device)
        d = self.stack.dim
        self.d = d
        log_pi = torch.cat([torch.log(c.weights).to(dtype) for c in clients])
        # Normalised log N(w; ŵ, Λ⁻¹) = log π + ½ log|Λ| − d/2 log 2π − ½ q
        self.log_norm = log_pi.to(device) + gaussian_log_norm(self.stack.logdets, d)  # (N,)
        # The prior correction  Σ_c log N(w; 0, λ_c⁻¹ I) − log N(w; 0, λ0⁻¹ I) = const − ½ (Σ λ_c − λ0) ‖w‖²
        lam_sum, lam0 = math.fsum(prior_precisions), float(server_prior_precision)
        self.prior_const = 0.5 * d * (sum(math.log(lam) for lam in prior_precisions) - math.log(lam0)
                                      - (len(prior_precisions) - 1) * LOG_2PI)
        self.prior_slope = lam_sum - lam0  # the correction's gradient is −(Σ λ_c − λ0) (w − μ)
        self.prior_centres = None if prior_centres is None else prior_centres.to(device=device, dtype=dtype)
        self.chunk_bytes = default_chunk_bytes(device) if chunk_bytes is None else chunk_bytes
        self._chunks: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
        # each component's client (index into the clients): the per-client softmax of ragged clients
        self.client_of = torch.tensor([i for i, (a, b) in enumerate(self.groups) for _ in range(a, b)], device=device)
        # on a GPU the step is bound by kernel launches: replay it as one CUDA graph
        self._graphed = GraphedStep(self._value_and_gradient) if cuda_graphs and torch.device(device).type == "cuda" else None

    def chunks(self, K: int, element_size: int) -> list[list[tuple[int, int]]]:
        """The client groups ``(start, stop)`` evaluated together for ``K`` points (remembered per
        ``(K, element_size)``: this runs every optimiser step)."""
        key = (K, element_size)
        if key not in self._chunks:
            self._chunks[key] = self._make_chunks(K, element_size)
        return self._chunks[key]

    def _make_chunks(self, K: int, element_size: int) -> list[list[tuple[int, int]]]:
        per_component = 3 * K * self.d * element_size
        out: list[list[tuple[int, int]]] = [[]]
        used = 0
        for a, b in self.groups:
            cost = (b - a) * per_component
            if out[-1] and self.chunk_bytes > 0 and used + cost > self.chunk_bytes:
                out.append([])
                used = 0
            out[-1].append((a, b))
            used += cost
        return out

    def value_and_gradient(self, W: torch.Tensor, gradient: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``W`` ``(K, d)`` -> values ``(K,)`` of ``−log p(w | D)`` and, with ``gradient``, their
        gradients ``(K, d)`` (row k is ``∂ value_k / ∂ W_k``; the rows are independent).

        No autograd: each block returns its forms with their vector-Jacobian product
        (:meth:`StackedGaussians.forms_and_vjp`), so the gradient reuses the forward products
        and costs no graph (at C = 5, M = 1 the graph and Function calls were ~1/3 of a step).
        On CUDA the step (with ``gradient``) is replayed from a captured CUDA graph
        (:class:`~posterior_fusion.kernels.graphs.GraphedStep`)."""
        W = W.detach()
        if gradient and self._graphed is not None:  # eager for CPU tensors
            return self._graphed(W)
        return self._value_and_gradient(W, gradient)

    def _value_and_gradient(self, W: torch.Tensor, gradient: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`value_and_gradient`, eagerly (no host synchronisation: it may be captured as a CUDA graph)."""
        K = W.shape[0]
        D = W
        if self.prior_centres is not None:
            if self.prior_centres.shape != W.shape:  # a caller's bug, not a user's input
                raise ValueError(f"{tuple(W.shape)} points against {tuple(self.prior_centres.shape)} prior centres")
            D = W - self.prior_centres
        values = D.square().sum(-1).mul_(-0.5 * self.prior_slope).add_(self.prior_const)  # the prior correction
        grad = None
        for chunk in self.chunks(K, W.element_size()):
            first, last = chunk[0][0], chunk[-1][1]
            stack = self.stack if (first, last) == (0, self.stack.num) else self.stack.select(first, last)
            q, vjp = stack.forms_and_vjp(W)  # (K, n), no autograd graph
            log_comp = torch.add(self.log_norm[first:last], q, alpha=-0.5)
            sizes = [b - a for a, b in chunk]
            if len(set(sizes)) == 1:  # every client has the same number of components: one reshape
                per_client = log_comp.view(K, len(chunk), sizes[0])
                lse = torch.logsumexp(per_client, dim=-1)  # (K, C')
                r = per_client.sub_(lse[..., None]).exp_().view(K, -1) if gradient else None
            else:
                lse = torch.stack([torch.logsumexp(log_comp[:, a - first : b - first], -1) for a, b in chunk], 1)
                own = self.client_of[first:last] - self.client_of[first]  # each component's client in the chunk
                r = log_comp.sub_(lse.index_select(1, own)).exp_() if gradient else None
            values -= lse.sum(1)
            if gradient:  # ∂/∂W Σ_c lse_c = Σ_n r_n · (−½ ∂q_n/∂W), r = each client's softmax
                part = vjp(r)
                grad = part if grad is None else grad.add_(part)
        if grad is not None:  # ½ Σ r ∂q/∂W, then the prior correction's −(Σ λ_c − λ0) (w − μ)
            grad.mul_(0.5).add_(D, alpha=-self.prior_slope)
        return values, grad

    def __call__(self, W: torch.Tensor) -> torch.Tensor:
        """``(K, d)`` -> ``(K,)`` values of ``−log p(w | D)``, differentiable w.r.t. ``W`` (once)."""
        if torch.is_grad_enabled() and W.requires_grad:
            return _NegLogPosterior.apply(W, self)
        return self.value_and_gradient(W, gradient=False)[0]


class _NegLogPosterior(torch.autograd.Function):
    """:meth:`GlobalLogPosterior.value_and_gradient` as a Function: the gradient is computed in the
    forward pass, chunk by chunk, and only scaled in the backward pass."""

    @staticmethod
    def forward(ctx, W, objective):  # noqa: D102
        values, grad = objective.value_and_gradient(W)
        ctx.save_for_backward(grad)
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_values):  # noqa: D102
        (grad,) = ctx.saved_tensors
        return grad_values[:, None] * grad, None


def require_shared_inits(inputs: FusionInputs) -> None:
    """Refuse clients trained from different starting points (recorded ``init.fingerprint``)."""
    prints = [(c.path, (c.metadata.get("init") or {}).get("fingerprint")) for c in inputs.clients]
    known = [(p, f) for p, f in prints if f is not None]
    if len({f for _, f in known}) > 1:
        first = known[0]
        odd = next(p for p, f in known if f != first[1])
        raise IncompatibleArtifactsError(f"{odd}: trained from other starting points than {first[0]} (init fingerprints "
                                         "differ); use one init file or `init_seed` for every silo, or `set` "
                                         "allow_different_inits=true")


STARTS = ("median", "clients", "median+clients")
SOLVERS = ("auto", "adam", "em")
PRIOR_CENTRES = ("auto", "zero", "clients")
LAPLACE_PRIORS = ("server", "evidence")
SERVER_PRIORS = ("auto", "clients", "evidence")
EVIDENCE_ROUNDS = 30       # server_prior=evidence: at most this many EM solves
EVIDENCE_TOLERANCE = 0.01  # … stopping when λ0 moves by less than this, relative
RESOLUTION = 1e-6          # … keeping each λ0_j ≥ this × block j's largest curvature (float32 resolves ≈ 1e-8 of it)


def damped_clients(clients: list[ClientPosterior], d: float) -> list[ClientPosterior]:
    """The clients with every component's curvature damped by ``d`` at per-sample scale
    (:meth:`~posterior_fusion.curvature.base.Precision.damped`, ``n`` = the client's sample count)."""
    return [dataclasses.replace(c, components=tuple(dataclasses.replace(comp, curvature=comp.curvature.damped(c.n_data, d))
                                                    for comp in c.components)) for c in clients]


def client_starts(inputs: FusionInputs) -> torch.Tensor:
    """``(C·M, d)``: every client component's MAP (client-major)."""
    return torch.stack([comp.map.float() for c in inputs.clients for comp in c.components])


def median_starts(inputs: FusionInputs, modes: int) -> torch.Tensor:
    """``(modes, d)``: element-wise median over clients of ŵ_cm for each mode index m."""
    return torch.stack([inputs.mode_maps(m).median(dim=0).values for m in range(modes)])


def start_rows(inputs: FusionInputs, starts: str, modes: int) -> tuple[torch.Tensor, list[int]]:
    """The starts ``(K, d)`` of ``starts`` (:data:`STARTS`) and the component index each row comes from
    (what its prior centre averages): the ``modes`` median starts, then, with ``clients``, every client
    component's MAP (client-major)."""
    rows = []
    if starts in ("median", "median+clients"):
        rows.append((median_starts(inputs, modes), list(range(modes))))
    if starts in ("clients", "median+clients"):
        rows.append((client_starts(inputs), [m for c in inputs.clients for m in range(c.num_components)]))
    return torch.cat([w for w, _ in rows]), [m for _, ms in rows for m in ms]


MERGE_TOLERANCE = 1e-5  # rows within this relative distance of an earlier one are the same mode


def coinciding_rows(W: torch.Tensor, keys: list[int], tolerance: float) -> list[list[int]]:
    """Rows of ``W`` ``(K, d)`` that are one mode: groups (in row order, each led by its first row) of rows with
    the same ``keys`` entry (the objective a row was optimised against: its prior centre's component index)
    within ``tolerance`` of the group's first row, relative to the larger norm. EM's stationary point does not
    depend on the start (measured: every start of one component index reaches the same point to ≈ 1e-8), so
    several starts can end on one mode; a row joins the first group it fits.

    No float64 copy of ``W`` (at C·M = 200 rows of a width-64 ResNet it would be 7 GB): norms are accumulated
    in float64 row by row, the difference of two close float32 rows is exact, and rows whose norms differ by more
    than the tolerance (most distinct rows) are told apart without forming it (``|‖a‖ − ‖b‖| ≤ ‖a − b‖``)."""
    norms = [float(torch.linalg.vector_norm(w, dtype=torch.float64)) for w in W.detach()]
    groups: list[list[int]] = []
    for k in range(W.shape[0]):
        for g in groups:
            j = g[0]
            limit = tolerance * max(norms[j], norms[k])
            if (keys[j] == keys[k] and abs(norms[j] - norms[k]) <= limit
                    and float(torch.linalg.vector_norm(W[k].detach() - W[j].detach(), dtype=torch.float64)) <= limit):
                g.append(k)
                break
        else:
            groups.append([k])
    return groups


def client_centres(inputs: FusionInputs, components: list[int]) -> torch.Tensor:
    """``(K, d)``: for each start row's component index m, ``Σ_c λ_c ŵ_cm / Σ_c λ_c``."""
    lams = torch.tensor([inputs.prior_precision(c) for c in inputs.clients], dtype=torch.float64)
    means = {m: (lams[:, None] * inputs.mode_maps(m).double()).sum(0) / lams.sum() for m in set(components)}
    return torch.stack([means[m] for m in components]).float()


def per_block_client_sum(clients: list[ClientPosterior], temps: list[float], value) -> list[float]:
    """Per curvature block j, ``Σ_c mean_m value(G_cm,j) / T_c`` (``value``: a block -> a float)."""
    blocks = len(clients[0].components[0].curvature.blocks)
    return [math.fsum(sum(value(comp.curvature.blocks[j]) for comp in c.components) / (c.num_components * t)
                      for c, t in zip(clients, temps)) for j in range(blocks)]


def curvature_scales(clients: list[ClientPosterior], temps: list[float]) -> list[float]:
    """Per curvature block j, ``c_j``: the mean diagonal entry of the clients' summed tempered curvature
    ``Σ_c mean_m G_cm / T_c`` over the block (how much curvature the block has per parameter)."""
    return per_block_client_sum(clients, temps, lambda block: float(block.diagonal().double().mean()))


def curvature_tops(clients: list[ClientPosterior], temps: list[float]) -> list[float]:
    """Per curvature block j, ``Σ_c mean_m λ_max(G_cm) / T_c``: an upper bound of the largest eigenvalue of the
    clients' summed tempered curvature (float64, from each block's clamped, cached spectrum)."""
    def top(block) -> float:
        values, other = block.spectrum()
        return float(values.max()) * (float(other.max()) if other is not None else 1.0)

    return per_block_client_sum(clients, temps, top)


def server_prior_blocks(scales: list[float], rho: float, lam0: float) -> list[float]:
    """The server prior's precision per curvature block at scale ρ: ``λ0_j = ρ c_j`` (``scales``: the blocks'
    ``c_j``, :func:`curvature_scales`); a block without curvature (``c_j ≤ 0``) keeps the clients' ``lam0``."""
    return [rho * c if c > 0 else lam0 for c in scales]


def evidence_server_prior(clients: list[ClientPosterior], temps: list[float], lams: list[float], lam0: float,
                          W0: torch.Tensor, centres: torch.Tensor | None, settings: FedBEnsSettings,
                          show_progress: bool = True) -> tuple[list[float], torch.Tensor, list, dict, tuple | None]:
    """``server_prior=evidence``: one server prior precision per curvature block, ``λ0_j = ρ c_j`` with
    ``c_j`` the block's curvature per parameter (:func:`curvature_scales`; a block without curvature keeps
    the clients' λ0), and the scale ρ at which the modes' Laplace evidence is stationary, the modes EM's
    stationary points at those λ0_j.

    The clients' likelihoods ``q_c / p0_c`` do not depend on the server's prior, so
    ``Z(ρ) = ∫ Π_c (q_c / p0_c)(w) N(w; μ, diag(λ0_j I)⁻¹) dw`` is a marginal likelihood in ρ; at stationary
    modes the derivative of its Laplace approximation is ``½ (γ/ρ − Σ_j c_j ‖w*_j − μ_j‖²)`` with
    ``γ = Σ_i h_i / (h_i + λ0_j)`` over the curvature at the modes (MacKay). Each round solves EM from the
    last round's modes, then moves ρ to the maximiser with those modes held fixed
    (:func:`~posterior_fusion.fusion.mode_laplace.evidence_prior_precision` on ``w* − μ`` with the block
    scales), until ρ moves by less than :data:`EVIDENCE_TOLERANCE` (at most :data:`EVIDENCE_ROUNDS` rounds;
    then the last round's are kept and the record says so). The first ρ puts the parameter-weighted mean
    λ0_j at the clients' λ0. Returns ``(λ0 per block, modes (K, d), their EM history, the record
    {block_scales, rounds: [{scale, next, em_steps}], converged, at_bound}, the last round's
    :func:`mode_precisions` at the modes or None)`` (the Laplace step at the modes reuses it: it does not
    depend on λ0)."""
    scales = [max(c, 0.0) for c in curvature_scales(clients, temps)]
    dims = [b.dim for b in clients[0].components[0].curvature.blocks]
    seen = [c > 0 for c in scales]
    seen_dims = sum(n for n, ok in zip(dims, seen) if ok)
    weighted = math.fsum(c * n for c, n in zip(scales, dims)) / max(seen_dims, 1)  # mean c_j over seen parameters
    # every λ0_j stays in the artifacts' prior-precision range (the evidence may have no interior maximum) and
    # above what the float32 curvature resolves (RESOLUTION × the block's largest curvature: below that a
    # summed precision may be indefinite in its rounding; ≤ RESOLUTION × the block's size in ρ, so ≤ 0.04 on
    # the LeNet and ResNet-20 width-16 blocks, whose evidence gave ρ = 0.07–0.14)
    floor = max((RESOLUTION * t / c for t, c in zip(curvature_tops(clients, temps), scales) if c > 0), default=0.0)
    lo = max(ranges.PRIOR_PRECISION[0] / min((c for c in scales if c > 0), default=1.0), EVIDENCE_RANGE[0], floor)
    hi = min(ranges.PRIOR_PRECISION[1] / max(scales, default=1.0), EVIDENCE_RANGE[1])
    rho = min(max(lam0 / weighted if weighted > 0 else 1.0, lo), hi)

    W, rounds, history, converged, laplace_step = W0, [], [], False, None
    for i in progress(range(EVIDENCE_ROUNDS), "server prior (evidence)", EVIDENCE_ROUNDS, show=show_progress):
        lams0 = server_prior_blocks(scales, rho, lam0)
        W, history = em_modes(MixtureProduct(clients, temps, lams, lams0), W, settings.steps, show_progress=False,
                              trust_radius=settings.trust_radius, prior_centres=centres)
        if not any(seen):
            converged = True
            break
        laplace_step = mode_precisions(clients, temps, lams, lam0, W, show_progress=False)
        offsets = W if centres is None else W - centres
        nxt, _ = evidence_prior_precision(list(offsets), laplace_step[0], block_scales=scales)
        nxt = min(max(nxt, lo), hi)
        rounds.append({"scale": rho, "next": nxt, "em_steps": [len(h) - 1 for h in history]})
        if abs(math.log(nxt / rho)) < EVIDENCE_TOLERANCE:
            converged = True
            break
        if i + 1 < EVIDENCE_ROUNDS:  # else the last modes are kept with the ρ they were solved at
            rho, laplace_step = nxt, None  # the modes will move: their curvature with them
    at_bound = rho >= hi * (1 - 1e-6) or rho <= lo * (1 + 1e-6)
    if not converged:
        warnings.warn(f"fedbens server_prior=evidence: ρ still moved after {EVIDENCE_ROUNDS} rounds (last "
                      f"{rounds[-1]['scale']:.3g} -> {rounds[-1]['next']:.3g}); the last round's modes are kept",
                      stacklevel=3)
    elif at_bound:
        upper = rho >= hi * (1 - 1e-6)
        why = ("the clients disagree more than their curvature explains, and the modes sit at the prior centre"
               if upper else "the prior is as weak as the curvature's float32 resolution or the artifacts' range "
               "allows; a client whose curvature is far out of scale with the others' does this (see --robust)")
        warnings.warn(f"fedbens server_prior=evidence: the evidence has no maximum inside the prior precisions "
                      f"the artifacts allow; ρ = {rho:.3g} is at its {'upper' if upper else 'lower'} bound: {why}",
                      stacklevel=3)
    return server_prior_blocks(scales, rho, lam0), W, history, {"block_scales": scales, "rounds": rounds, "converged": converged,
                                         "at_bound": at_bound}, laplace_step


VALIDATION_FREE_STRUCTURES = ("kron",)  # where solver=auto without validation data runs EM (measured better there)


def resolve_auto(settings: FedBEnsSettings, has_val: bool, structure: str = "kron") -> FedBEnsSettings:
    """``settings`` with every ``auto`` replaced by what runs. ``solver=auto`` is EM at a stationary point when
    the server has no validation data and the clients' curvature is Kronecker (:data:`VALIDATION_FREE_STRUCTURES`),
    or when a setting asks for EM (``server_prior=evidence``, ``trust_radius``); then ``prior_centre`` /
    ``server_prior`` left at ``auto`` take the validation-free fusion's ``clients`` / ``evidence``
    (``docs/results/fusion_safety/README.md``: without validation data Adam keeps its best-objective iterate,
    which under strong heterogeneity predicts far worse on K-FAC curvature). Otherwise it is the paper's Adam
    (with validation data its best validation iterate): on diagonal curvature the stationary point predicts
    far worse than Adam's early iterates, validation or not (measured in session 24). An explicit ``solver``
    keeps the paper's ``zero`` centre and the clients' λ0 unless they are set; an explicit ``adam`` where
    ``auto`` would run the validation-free fusion is warned about once."""
    validation_free = not has_val and structure in VALIDATION_FREE_STRUCTURES
    if settings.solver == "adam" and validation_free:
        warnings.warn("fedbens solver=adam without validation data: Adam keeps its best-objective iterate, "
                      "which under strong heterogeneity can predict far worse than the paper's best-validation one "
                      "(docs/results/fusion_safety/); the default solver=auto runs the stationary fusion that "
                      "needs no validation data (EM, prior_centre=clients, server_prior=evidence)", stacklevel=4)
    auto_em = settings.solver == "auto" and (validation_free or settings.server_prior == "evidence"
                                             or settings.trust_radius > 0)
    solver = settings.solver if settings.solver != "auto" else ("em" if auto_em else "adam")
    centre = settings.prior_centre if settings.prior_centre != "auto" else ("clients" if auto_em else "zero")
    prior = settings.server_prior if settings.server_prior != "auto" else ("evidence" if auto_em else "clients")
    return dataclasses.replace(settings, solver=solver, prior_centre=centre, server_prior=prior)


def fedbens(inputs: FusionInputs, settings: FedBEnsSettings) -> FusionResult:
    """FedBEns on any curvature structure (kron, diag, diag+full); ``auto`` settings resolved by
    :func:`resolve_auto` (what ran is recorded as ``resolved``)."""
    settings = resolve_auto(settings, inputs.val is not None, inputs.clients[0].structure)
    resolved = {"solver": settings.solver, "prior_centre": settings.prior_centre, "server_prior": settings.server_prior}
    m = require_equal_components(inputs, "fedbens")
    if not settings.allow_different_inits:
        require_shared_inits(inputs)
    modes = settings.modes or m
    if modes > m:
        raise ConfigError(f"setting modes={modes} exceeds the clients' number of components {m}")
    clients = damped_clients(inputs.clients, settings.damping) if settings.damping else inputs.clients
    temps = [inputs.temperature(c) for c in inputs.clients]
    lams = [inputs.prior_precision(c) for c in inputs.clients]
    lam0 = inputs.server_prior_precision()
    W0, components = start_rows(inputs, settings.starts, modes)
    centres = client_centres(inputs, components) if settings.prior_centre == "clients" else None
    laplace_step = None
    if settings.server_prior == "evidence":  # lam0 becomes one λ0 per curvature block
        lam0, best, history, search, laplace_step = evidence_server_prior(clients, temps, lams, lam0, W0, centres,
                                                                          settings, inputs.options.progress)
        info = {"history": history, "server_prior_search": search}
    elif settings.solver == "em":  # per-layer solves on the clients' own blocks: no stacked copy of them
        best, history = em_modes(MixtureProduct(clients, temps, lams, lam0), W0, settings.steps,
                                 show_progress=inputs.options.progress, trust_radius=settings.trust_radius,
                                 prior_centres=centres)
        info = {"history": history}
    else:
        objective = GlobalLogPosterior(clients, temps, lams, lam0, lowrank_tol=settings.lowrank_tol,
                                       kernel=inputs.options.kernel, device=inputs.options.device,
                                       show_progress=inputs.options.progress, prior_centres=centres)
        best, history = optimise_modes(objective, W0, inputs, settings, "fedbens")
        info = {"history": history, "kron_ranks": objective.stack.ranks}
        del objective  # the stacks: the Laplace step below works from the clients' blocks
    info["resolved"] = resolved
    # several starts may end on one mode (with EM, measured: every start of one component index): one member
    # each, weighted by its share of the starts — the predictive of the duplicated rows, once per mode
    groups = coinciding_rows(best, components if centres is not None else [0] * len(components), MERGE_TOLERANCE)
    share = torch.tensor([len(g) for g in groups], dtype=torch.float64) / len(components)  # (K',) starts' share
    merged = len(groups) < len(components)
    if merged:
        keep = [g[0] for g in groups]
        best = best[keep]
        centres = None if centres is None else centres[keep]
        if laplace_step is not None:
            laplace_step = ([laplace_step[0][k] for k in keep], [laplace_step[1][k] for k in keep])
        info["members_from_starts"] = groups
        if not settings.laplace:
            info["mode_weights"] = share.tolist()
    if not settings.laplace:
        return FusionResult([w.clone() for w in best], info)
    curvatures, errors = laplace_step or mode_precisions(clients, temps, lams, lam0, best, inputs.options.progress)
    values = negative_log_posterior(clients, temps, lams, lam0, best, centres)
    laplace = {"prior_precision": lam0, "prior_rule": settings.laplace_prior, "server_prior_precision": lam0,
               "server_prior": settings.server_prior}
    if settings.laplace_prior == "evidence":
        delta, evidence = evidence_prior_precision(list(best), curvatures)
        laplace.update({"prior_precision": delta, "log_evidence_terms": evidence})
    precisions = [c.precision(1.0, laplace["prior_precision"]) for c in curvatures]
    if settings.mode_weights == "laplace":
        weights = laplace_mode_weights(values, precisions)
        if merged:  # a mode reached from several starts keeps the mass of its rows
            weights = weights * share / (weights * share).sum()
    else:  # equal per start: uniform over the members when no start merged
        weights = share
    info.update({"laplace": {**laplace, "block_relative_errors": errors, "objective_at_modes": values.tolist()},
                 "mode_weights": weights.tolist()})
    return FusionResult([w.clone() for w in best], info, curvatures)


def _modes(settings: FedBEnsSettings, size) -> int:
    """K, the number of global modes: from the median starts, the client components, or both."""
    modes = settings.modes or size.components
    n = size.clients * size.components
    return {"median": modes, "clients": n, "median+clients": modes + n}[settings.starts]


def _work_bytes(settings: FedBEnsSettings, size) -> int:
    """K modes against one chunk of clients at a time (about 3·K·d numbers per component, chunks of
    at most ``default_chunk_bytes`` or one client), K parameter vectors with their gradient, Adam
    moments and best iterate."""
    k = _modes(settings, size)
    per_component = 3 * k * size.d * 4
    n = size.clients * size.components
    chunk = min(n, max(size.components, CHUNK_BYTES // per_component))
    return chunk * per_component + 6 * k * size.d * 4


METHOD = FusionMethod("fedbens", fedbens, FedBEnsSettings, "modes of the product of client mixtures (FedBEns)",
                      optimises=True, members=_modes, work_bytes=_work_bytes, tunable=True)
