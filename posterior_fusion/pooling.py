"""How a global artifact's members' class probabilities combine into one prediction.

* ``average`` (the default): ``Σ_k π_k p_k(y|x)``, the mixture over members with the artifact's
  mode weights ``π``.
* ``label-shift``: the members are the clients' own models (the ``ensemble`` method) and each
  client saw its own label distribution. Under label shift — the clients share the class
  conditionals ``p(x|y)`` and differ in their label priors ``π_c(y)`` — client ``c``'s predictive
  (the average of its members) is ``p_c(y|x) = p(x|y) π_c(y) / p_c(x)``, so

      ρ(x, y) := p(x|y) / p(x) = p_c(y|x) / π_c(y) · a_c(x),   a_c(x) = p_c(x) / p(x) = Σ_y π_c(y) q(y|x) / π(y),

  with ``q(y|x) = π(y) ρ(x, y)`` the global posterior of the pooled data (global prior ``π``). Every
  client thus estimates the same ``ρ``; the estimates are combined class by class in log space,
  weighted by how much of that class each client saw, and ``q`` is the fixed point

      log q(y|x) = log π(y) + Σ_c w_c(y) [log p_c(y|x) − log π_c(y) + log a_c(x; q)] + const(x),
      π_c(y) = n_c(y) / n_c,   π(y) = Σ_c n_c(y) / Σ_c n_c,   w_c(y) ∝ n_c(y) + s where n_c(y) > 0, else 0,

  from the class counts ``n_c(y)`` every client artifact records. The label priors are the clients'
  own, unsmoothed: when every client's predictive is its exact Bayes posterior under its own count prior, the
  pooled-data posterior is the fixed point whatever the weights (each client that saw ``y`` estimates the same ``ρ``).
  A client that never saw a class has no say on it at any ``s``; a class no client saw has probability 0. ``s``
  (``smoothing``) only evens the per-class weights of tiny counts. The fixed point is solved: the start is the
  maximiser of a concave likelihood (:func:`likelihood_start`, exact where the clients are), then Newton's method
  on the fixed point in ``log a_c`` (:func:`solve_fixed_point`) until no step moves a ``log a_c`` by more than
  :data:`TOLERANCE` (at most ``iterations`` steps, :data:`ITERATIONS` by default). With real models some inputs
  have no interior fixed point (a client that saw a handful of examples of a class predicts it, its ``a_c(x)``
  slides towards 0). One warning, with the residual, whenever the next Newton step would still move a probability
  by more than :data:`WARN_RESIDUAL`.

  ``robust`` (``fuse --robust``, the ensemble's setting ``robust``): one lying client must not move
  the pool, and honest clients are left exactly as they are. A count claim is checked against the client's
  curvature: ``fuse --robust`` leaves out a client whose curvature per claimed example is off the median by more than
  5x (:mod:`posterior_fusion.fusion.robust`), and :func:`robust_label_shift_pool` given ``count_evidence`` scales a
  claim beyond :data:`EVIDENCE_RATIO` × its evidence down to it. On the inputs being predicted (no labels; at least
  :data:`SCREEN_ROWS`), each pair of clients with two or more classes making up :data:`SCREEN_SUPPORT` of both
  clients' data is compared (their predictives moved to one label prior, mean total-variation distance: 0 for exact
  clients whatever their priors); a client's score is the median over its partners (:func:`disagreement`); one
  above :data:`SCREEN_FLOOR` and :data:`SCREEN_MADS` median absolute deviations above the median is left out, named
  in a warning. Measured in ``experiments/pool_robustness/`` and on conjugate federations in ``tests/test_pooling.py``.

  ``target_prior``: the pool answers under the pooled clients' label prior ``π``; data that follows another prior
  ``π_t`` (e.g. uniform test sets) is predicted by ``q_t(y|x) ∝ q(y|x) π_t(y) / π(y)``.
Shapes: member probabilities ``(K, n, classes)``; the result ``(n, classes)`` (float64).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posterior_fusion import ranges
from posterior_fusion.choices import POOLINGS
from posterior_fusion.errors import ConfigError

TOLERANCE = 1e-11        # a row stops once its Newton step moves no log a_c by more than this
ITERATIONS = 200         # ... or after this many Newton steps (the default; each row stops on its own)
FIXED_POINT_BYTES = 64 * 2**20  # the Newton step's Jacobians of one chunk of rows, at most (many clients)
LIKELIHOOD_ROUNDS = 100  # Newton steps at most of the likelihood start
WARN_RESIDUAL = 1e-10    # a residual above this at the end warns (module doc)
EVIDENCE_RATIO = 5.0  # robust: a count claim beyond this x what the client's curvature supports is scaled down to it
SCREEN_MADS = 5.0     # robust: a client this many median absolute deviations above the median disagreement ...
SCREEN_FLOOR = 0.1    # ... and above this mean total-variation distance is left out
SCREEN_ROWS = 50      # robust: the screen needs at least this many inputs in the batch
SCREEN_SUPPORT = 0.01  # robust: a pair is compared on the classes that make up at least this share of both clients' data


@dataclass(frozen=True)
class Pooling:
    """The combination rule of a global artifact (metadata field ``pooling``).

    ``groups[k]``: the client of member ``k``; ``class_counts[c]``: client ``c``'s training
    examples per class (both for ``label-shift`` only)."""

    rule: str = "average"
    groups: tuple[int, ...] = ()
    class_counts: tuple[tuple[int, ...], ...] = ()
    smoothing: float = 0.5
    iterations: int = ITERATIONS
    target_prior: tuple[float, ...] = ()  # () : the pooled clients' label prior
    robust: bool = False  # cap count claims and screen out a client that predicts unlike the others (module doc)
    where: str = field(default="pooling", compare=False)

    def validate(self, num_members: int, num_classes: int) -> None:
        """Refuses (one line, naming ``where``) a rule, grouping or count table that does not fit
        ``num_members`` members and ``num_classes`` classes."""
        if self.rule not in POOLINGS:
            raise ConfigError(f"{self.where}: unknown pooling {self.rule!r}; use one of {', '.join(POOLINGS)}")
        if self.rule == "average":
            return
        ranges.check(f"{self.where}: smoothing", self.smoothing, ranges.POOLING_SMOOTHING)
        ranges.check(f"{self.where}: iterations", self.iterations, ranges.POOLING_ITERATIONS)
        clients = len(self.class_counts)
        if len(self.groups) != num_members or not all(0 <= g < clients for g in self.groups):
            raise ConfigError(f"{self.where}: groups must name a client in [0, {clients}) for each of the "
                              f"{num_members} members")
        if set(self.groups) != set(range(clients)):
            raise ConfigError(f"{self.where}: every client needs at least one member")
        if any(len(row) != num_classes or min(row) < 0 for row in self.class_counts):
            raise ConfigError(f"{self.where}: class_counts must hold {num_classes} counts >= 0 per client")
        if self.target_prior and (len(self.target_prior) != num_classes
                                  or not all(isinstance(v, float) and math.isfinite(v) and 0 <= v <= 1e12
                                             for v in self.target_prior) or sum(self.target_prior) <= 0):
            raise ConfigError(f"{self.where}: target_prior must hold {num_classes} finite frequencies >= 0, not all 0")

    @classmethod
    def from_metadata(cls, raw: Any, num_members: int, num_classes: int) -> Pooling:
        """The metadata field ``pooling`` (untrusted JSON) as a record, every field typed and in
        range for ``num_members`` members and ``num_classes`` classes (one :class:`ConfigError` line
        otherwise)."""
        where = "metadata field 'pooling'"
        if not isinstance(raw, dict) or raw.get("rule") not in POOLINGS:
            raise ConfigError(f"{where} must be an object whose rule is one of {', '.join(POOLINGS)}")
        if raw["rule"] == "average":
            if set(raw) != {"rule"}:
                raise ConfigError(f"{where}: average takes no other field")
            return cls()
        fields = {"rule", "groups", "class_counts", "smoothing", "iterations"}
        if not fields <= set(raw) <= fields | {"target_prior", "robust"}:
            raise ConfigError(f"{where}: {raw['rule']} needs exactly the fields {', '.join(sorted(fields))} "
                              "(and optionally target_prior, robust)")
        if (robust := raw.get("robust")) is not None and not isinstance(robust, bool):
            raise ConfigError(f"{where}: robust must be true or false")
        target = raw.get("target_prior", [])
        if not isinstance(target, list) or len(target) not in (0, num_classes) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in target):
            raise ConfigError(f"{where}: target_prior must list {num_classes} class frequencies (or be absent)")
        groups, counts = raw["groups"], raw["class_counts"]
        if not isinstance(groups, list) or len(groups) != num_members or not all(map(ranges.is_int, groups)):
            raise ConfigError(f"{where}: groups must list the client (an integer) of each of the {num_members} members")
        if (not isinstance(counts, list) or not 1 <= len(counts) <= num_members
                or not all(isinstance(r, list) and len(r) == num_classes and all(map(ranges.is_int, r)) for r in counts)):
            raise ConfigError(f"{where}: class_counts must hold 1 to {num_members} rows of {num_classes} integers")
        if max(max(r) for r in counts) > ranges.N_DATA[1]:
            raise ConfigError(f"{where}: a class count exceeds {ranges.N_DATA[1]:g}")
        smoothing, iterations = raw["smoothing"], raw["iterations"]
        ranges.check(f"{where}: smoothing", smoothing, ranges.POOLING_SMOOTHING)
        if not ranges.is_int(iterations):
            raise ConfigError(f"{where}: iterations must be an integer")
        out = cls(raw["rule"], tuple(groups), tuple(tuple(r) for r in counts), float(smoothing), iterations,
                  tuple(float(v) for v in target), bool(robust), where)
        out.validate(num_members, num_classes)
        return out

    def to_metadata(self) -> dict:
        if self.rule == "average":
            return {"rule": "average"}
        out = {"rule": self.rule, "groups": list(self.groups), "class_counts": [list(r) for r in self.class_counts],
               "smoothing": self.smoothing, "iterations": self.iterations}
        if self.target_prior:
            out["target_prior"] = list(self.target_prior)
        if self.robust:
            out["robust"] = True
        return out

    def combine(self, member_probs: Iterable[torch.Tensor], weights: torch.Tensor | None = None) -> torch.Tensor:
        """The pooled prediction ``(n, classes)`` from the members' probabilities, given one member
        at a time (each ``(n, classes)``, in member order; a ``(K, n, classes)`` tensor also works);
        ``weights`` ``(K,)``: the average's mixture weights, uniform if ``None``. Holds one
        ``(n, classes)`` sum per client at most."""
        sums: dict[int, torch.Tensor] = {}
        count = 0
        for k, p in enumerate(member_probs):
            key = self.groups[k] if self.rule == "label-shift" else 0
            scale = 1.0 if self.rule == "label-shift" or weights is None else float(weights[k])
            sums[key] = sums.get(key, 0) + scale * p.double()
            count += 1
        if self.rule == "average":
            return sums[0] / count if weights is None else sums[0]
        per_client = torch.stack([sums[c] / self.groups.count(c) for c in range(len(self.class_counts))])
        target = torch.tensor(self.target_prior, dtype=torch.float64) if self.target_prior else None
        counts = torch.tensor(self.class_counts, dtype=torch.float64)
        if self.robust:
            return robust_label_shift_pool(per_client, counts, self.smoothing, self.iterations, target)
        return label_shift_pool(per_client, counts, self.smoothing, self.iterations, target)


AVERAGE = Pooling()


def label_shift_pool(client_probs: torch.Tensor, class_counts: torch.Tensor, smoothing: float = 0.5,
                     iterations: int = ITERATIONS, target_prior: torch.Tensor | None = None) -> torch.Tensor:
    """The ``label-shift`` pooling (module doc) of the clients' predictives ``client_probs``
    ``(C, n, classes)`` with their class counts ``(C, classes)``; returns ``q`` ``(n, classes)``, float64,
    under the pooled clients' label prior, or ``target_prior`` ``(classes,)`` (frequencies) where given.
    The fixed point is solved by :func:`solve_fixed_point` from :func:`likelihood_start` (at most ``iterations``
    Newton steps); a residual above :data:`WARN_RESIDUAL` warns once with its value."""
    counts = class_counts.double()
    seen = counts > 0                                                       # (C, classes)
    prior_c = counts / counts.sum(1, keepdim=True)                          # π_c(y), the clients' own
    prior = counts.sum(0) / counts.sum()                                    # π(y), the pooled data's
    present = prior > 0
    raw = torch.where(seen, counts + smoothing, torch.zeros_like(counts))
    w = raw / raw.sum(0, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)   # Σ_c w_c(y) = 1 where y present
    log_p = client_probs.double().clamp_min(1e-300).log()
    evidence = torch.where(seen[:, None, :], log_p - prior_c.clamp_min(1e-300).log()[:, None, :],
                           torch.zeros_like(log_p))
    base = prior[present].log() + (w[:, None, :] * evidence).sum(0)[:, present]   # (n, P) over the present classes
    ratio = prior_c[:, present] / prior[present]                                  # π_c(y) / π(y)  (C, P)
    start = likelihood_start(client_probs.double()[:, :, present], counts[:, present])
    start = torch.softmax(start + prior[present].log(), -1)
    sub, residual = solve_fixed_point(base, w[:, present], ratio, (start @ ratio.T).clamp_min(1e-300).log(), iterations)
    if residual > WARN_RESIDUAL:
        warnings.warn(f"label-shift pool: the fixed point did not settle in {iterations} rounds (the residual, the "
                      f"largest change of a probability under one more Newton step, is {residual:.2g}); raise "
                      "`iterations`", stacklevel=2)
    q = torch.zeros(client_probs.shape[1], counts.shape[1], dtype=torch.float64)
    q[:, present] = sub
    if target_prior is not None:
        target = target_prior.double() / target_prior.double().sum()
        q = q * torch.where(present, target / prior.clamp_min(1e-300), torch.zeros_like(target))
        q = q / q.sum(-1, keepdim=True).clamp_min(1e-300)
    return q


def likelihood_start(client_probs: torch.Tensor, counts: torch.Tensor, rounds: int = LIKELIHOOD_ROUNDS) -> torch.Tensor:
    """The pool's start: ``ρ`` maximising the concave likelihood of the clients' predictives as soft labels,
    ``Σ_c n_c Σ_y p_c(y|x) log m_c(y)``, ``m_c = softmax_{y seen by c}(log ρ(y) + log π_c(y))`` — the clients'
    posteriors implied by one shared ``ρ`` — by Newton's method with a backtracking line search, every row at once.
    Its maximiser is unique where the clients' class sets overlap, and it is the exact pooled-prior posterior
    whenever the clients' predictives are exact. ``client_probs`` ``(C, n, P)`` and ``counts`` ``(C, P)`` over the
    classes some client saw; returns ``log ρ`` ``(n, P)`` (up to a constant per row), float64."""
    seen = counts > 0
    n_c = counts.sum(1)                                                             # (C,)
    log_prior_c = torch.where(seen, (counts / n_c[:, None]).clamp_min(1e-300).log(), -math.inf)
    p = client_probs * seen[:, None, :]
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    soft = torch.einsum("c,cnp->np", n_c, p)                                        # Σ_c n_c p_c(y|x)  (n, P)
    u = soft.clamp_min(1e-300).log() - (counts.sum(0) / counts.sum()).log()
    total, P = float(n_c.sum()), u.shape[1]
    flat = torch.ones(P, P, dtype=torch.float64) * total / P                        # removes the shift's null space

    def value(u: torch.Tensor, soft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = u[:, None, :] + log_prior_c[None]                                       # (m, C, P)
        lse = torch.logsumexp(z, -1)
        return (soft * u).sum(-1) - lse @ n_c, torch.exp(z - lse[..., None])

    idx = torch.arange(len(u))
    for _ in range(rounds):
        if len(idx) == 0:
            break
        soft_i, ui = soft[idx], u[idx]
        objective, m = value(ui, soft_i)
        nm = n_c[None, :, None] * m
        grad = soft_i - nm.sum(1)
        hess = torch.diag_embed(nm.sum(1)) - torch.einsum("ncp,ncq->npq", nm, m) + flat
        step = torch.linalg.lstsq(hess, grad.unsqueeze(-1)).solution.squeeze(-1)
        slope = (grad * step).sum(-1)
        moving = (step.abs().amax(-1) > 1e-12) & (slope > 1e-13 * total)
        idx, soft_i, ui, objective, step, slope = (t[moving] for t in (idx, soft_i, ui, objective, step, slope))
        t = torch.ones(len(idx), 1, dtype=torch.float64)
        taken = torch.zeros(len(idx), dtype=torch.bool)
        for _ in range(30):
            trial = ui + t * step
            ok = (value(trial, soft_i)[0] >= objective + 1e-4 * t[:, 0] * slope) & ~taken
            u[idx[ok]] = trial[ok]
            taken |= ok
            if taken.all():
                break
            t = torch.where(taken[:, None], t, t / 2)
        idx = idx[taken]                                                            # a row that cannot climb is done
    return u


def solve_fixed_point(base: torch.Tensor, w: torch.Tensor, ratio: torch.Tensor, log_a: torch.Tensor,
                      rounds: int = ITERATIONS) -> tuple[torch.Tensor, float]:
    """The pool's fixed point (module doc) for every row at once: ``base`` ``(n, P)`` (log prior plus the weighted
    evidence, P the classes some client saw), ``w`` ``(C, P)`` the per-class weights (summing to 1 over the
    clients), ``ratio`` ``(C, P)`` the clients' prior ratios ``π_c / π``, ``log_a`` ``(n, C)`` the start.

    The map depends on q only through the clients' ``a_c = Σ_y ratio_c(y) q(y)``, so it is solved in ``v = log a``:
    ``q(v) = softmax(base + v W)``, ``G(v) = log(q(v) Rᵀ)``, Newton's method on ``G(v) = v`` (its Jacobian
    ``(T − 1 qᵀ) Wᵀ``, ``T_c(y) = ratio_c(y) q(y) / a_c``), each step halved until the residual ``|G(v) − v|`` falls
    (a plain round where no halving does), at most ``rounds`` steps. A row stops once its Newton step moves no
    ``log a_c`` by more than :data:`TOLERANCE`. The residual returned is the largest change of a probability the
    next Newton step would make (0 where every row has stopped). Returns ``(q (n, P), residual)``, float64. Rows are
    solved in chunks whose ``(m, C, C)`` Jacobians fit :data:`FIXED_POINT_BYTES` (hundreds of clients)."""
    n, C = log_a.shape
    rows = max(1, FIXED_POINT_BYTES // (24 * C * C))  # the Jacobian, eye − J and lstsq's copy, float64
    if n > rows:
        parts = [solve_fixed_point(base[i : i + rows], w, ratio, log_a[i : i + rows], rounds) for i in range(0, n, rows)]
        return torch.cat([q for q, _ in parts]), max(r for _, r in parts)
    v, eye = log_a.clone(), torch.eye(C, dtype=torch.float64)

    def image(b: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.softmax(b + v @ w, -1)
        a = (q @ ratio.T).clamp_min(1e-300)
        return q, a, a.log()

    idx = torch.arange(n)
    residual = 0.0
    for k in range(rounds + 1):
        if len(idx) == 0:
            break
        b, vi = base[idx], v[idx]
        q, a, g = image(b, vi)
        r = g - vi
        jac = (ratio[None] * q[:, None, :] / a[:, :, None] - q[:, None, :]) @ w.T    # (m, C, C)
        step = torch.linalg.lstsq(eye - jac, r.unsqueeze(-1)).solution.squeeze(-1)
        moving = step.abs().amax(-1) > TOLERANCE
        idx, b, vi, q, g, r, step = (t[moving] for t in (idx, b, vi, q, g, r, step))
        if len(idx) == 0:
            residual = 0.0
            break
        residual = float((image(b, vi + step)[0] - q).abs().max())
        if k == rounds:
            break
        res = r.abs().amax(-1)
        nxt, taken, scale = g.clone(), torch.zeros(len(idx), dtype=torch.bool), 1.0
        for _half in range(10):
            trial = vi + scale * step
            rt = (image(b, trial)[2] - trial).abs().amax(-1)
            ok = ((rt < res) | (rt < 1e-14)) & torch.isfinite(rt) & ~taken
            nxt[ok] = trial[ok]
            taken |= ok
            if taken.all():
                break
            scale /= 2
        v[idx] = nxt
    return torch.softmax(base + v @ w, -1), residual


def checked_counts(class_counts: torch.Tensor, count_evidence: torch.Tensor | None,
                   ratio: float = EVIDENCE_RATIO) -> tuple[torch.Tensor, list[int]]:
    """``(C, classes)`` counts with the row of every client whose claimed total exceeds ``ratio`` × the count its
    curvature supports (``count_evidence`` ``(C,)``) scaled down to that count, and those clients. Without evidence
    the counts are returned as they are."""
    counts = class_counts.double()
    if count_evidence is None:
        return counts, []
    totals = counts.sum(1)
    evidence = count_evidence.double().clamp_min(0)
    over = totals > ratio * evidence
    scale = torch.where(over, evidence / totals.clamp_min(1e-300), torch.ones_like(totals))
    return counts * scale[:, None], [c for c in range(len(scale)) if bool(over[c])]


def disagreement(client_probs: torch.Tensor, class_counts: torch.Tensor) -> torch.Tensor:
    """Per client ``(C,)``: the median, over the other clients it shares at least two claimed classes with, of the
    mean total-variation distance between its predictive and theirs moved to its label prior, both restricted to
    the shared classes (each input weighted by the smaller of the two predictives' mass there). For clients whose
    predictives are their exact Bayes posteriors every pair agrees whatever their priors; a client trained on wrong
    labels disagrees with every partner, while one liar is a minority of an honest client's partners. NaN for a
    client with no partner (it is not screened)."""
    C = client_probs.shape[0]
    counts = class_counts.double()
    probs = client_probs.double()
    prior_c = counts / counts.sum(1, keepdim=True).clamp_min(1e-300)
    pair = torch.full((C, C), math.nan, dtype=torch.float64)
    for c in range(C):
        for k in range(c + 1, C):
            shared = (prior_c[c] >= SCREEN_SUPPORT) & (prior_c[k] >= SCREEN_SUPPORT)
            if int(shared.sum()) < 2:
                continue
            own, other = probs[c][:, shared], probs[k][:, shared]
            mass = torch.minimum(own.sum(-1), other.sum(-1))                          # (n,)
            moved = other * (prior_c[c, shared] / prior_c[k, shared])
            own = own / own.sum(-1, keepdim=True).clamp_min(1e-300)
            moved = moved / moved.sum(-1, keepdim=True).clamp_min(1e-300)
            tv = 0.5 * (own - moved).abs().sum(-1)
            pair[c, k] = pair[k, c] = (mass * tv).sum() / mass.sum().clamp_min(1e-300)
    scores = [pair[c][~pair[c].isnan()] for c in range(C)]
    return torch.stack([row.median() if len(row) else torch.tensor(math.nan, dtype=torch.float64) for row in scores])


def robust_label_shift_pool(client_probs: torch.Tensor, class_counts: torch.Tensor, smoothing: float = 0.5,
                            iterations: int = ITERATIONS, target_prior: torch.Tensor | None = None,
                            count_evidence: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`label_shift_pool` resisting one lying client (module doc, ``robust``): count claims beyond what the
    client's curvature supports (``count_evidence`` ``(C,)``, where given) scaled down to it, then a client that
    predicts unlike the others on the classes it claims left out; each named in a warning (client indices in the
    artifact's order). Where nobody lies it is :func:`label_shift_pool` itself."""
    counts, scaled = checked_counts(class_counts, count_evidence)
    if scaled:
        warnings.warn(f"label-shift pool (robust): client(s) {', '.join(map(str, scaled))} claim more than "
                      f"{EVIDENCE_RATIO:g}x the examples their curvature supports; their counts are scaled down to it",
                      stacklevel=2)
    keep = list(range(client_probs.shape[0]))
    if client_probs.shape[0] >= 3 and client_probs.shape[1] >= SCREEN_ROWS:
        scores = disagreement(client_probs, counts)
        screened = scores[~scores.isnan()]
        median = screened.median() if len(screened) else torch.zeros((), dtype=torch.float64)
        spread = (screened - median).abs().median() if len(screened) else median
        out = [c for c in keep if scores[c] > max(SCREEN_FLOOR, median + SCREEN_MADS * spread)]
        if out and len(out) < len(keep) / 2:
            warnings.warn(f"label-shift pool (robust): client(s) {', '.join(map(str, out))} predict unlike the "
                          f"others on the classes they claim (disagreement {', '.join(f'{float(scores[c]):.3g}' for c in out)}"
                          f" against a median of {float(median):.3g}); left out of this prediction", stacklevel=2)
            keep = [c for c in keep if c not in out]
    return label_shift_pool(client_probs[keep], counts[keep], smoothing, iterations, target_prior)


def client_groups(members_per_client: Sequence[int]) -> tuple[int, ...]:
    """``groups`` for members stored client after client: ``(0, 0, 1, 1, 1, …)``."""
    return tuple(c for c, m in enumerate(members_per_client) for _ in range(m))
