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
  own, unsmoothed: when every client's predictive is its exact Bayes posterior under its own count
  prior, the pooled-data posterior is the fixed point whatever the weights (each client that saw ``y``
  estimates the same ``ρ``). A client that never saw a class (``n_c(y) = 0``)
  has no say on it at any ``s``; a class no client saw has ``π(y) = 0`` and probability 0. ``s``
  (``smoothing``) only evens the per-class weights of tiny counts. The iteration starts from
  ``a_c = 1`` (:func:`solve_fixed_point`); each input stops once one more round moves none of its probabilities
  by more than :data:`TOLERANCE` (at most ``iterations`` rounds, :data:`ITERATIONS` by default). Where the clients'
  predictives are exact the fixed point is reached on most federations; where a client holds almost all of a
  class the iteration is slow, and with real models some inputs have no interior fixed point (a client that saw
  a handful of examples of a class predicts it, its ``a_c(x)`` slides towards 0). One warning, with the
  residual, whenever the largest move left is above :data:`WARN_RESIDUAL`.

  ``robust`` (``fuse --robust``, the ensemble's setting ``robust``): one lying client must not move
  the pool. Its count claim is capped — every client's counts scaled so its total is at most
  :data:`COUNT_CAP` × the clients' median total — and, on the inputs being predicted (no labels; at
  least :data:`SCREEN_ROWS`), each client's label-shift-corrected predictive is compared with the pool
  of the others on the classes it claims (mean total-variation distance); a client more than
  :data:`SCREEN_MADS` median absolute deviations above the median is left out of the pool, named in a
  warning. Measured in ``experiments/robustness/`` (one of five LeNet clients lying ×1,000 about its
  counts, or trained on shifted labels).

  ``target_prior``: the pool answers under the pooled clients' label prior ``π``; where the data to be
  predicted follows another prior ``π_t`` (e.g. uniform test sets), ``q_t(y|x) ∝ q(y|x) π_t(y) / π(y)``.

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
from posterior_fusion.errors import ConfigError

POOLINGS = ("average", "label-shift")
TOLERANCE = 1e-12      # the solver stops once one more round moves no probability by more than this
ITERATIONS = 10000     # ... or after this many rounds (the default; each row stops on its own)
WARN_RESIDUAL = 1e-6   # a residual above this at the end warns (module doc)
COUNT_CAP = 4.0    # robust: a client's counts scaled so its total is at most this x the clients' median total
SCREEN_MADS = 5.0  # robust: a client this many median absolute deviations above the median disagreement is left out
SCREEN_ROWS = 50   # robust: the screen needs at least this many inputs in the batch


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
        if not isinstance(raw.get("robust", False), bool):
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
                  tuple(float(v) for v in target), raw.get("robust", False), where)
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
    The fixed point is solved by :func:`solve_fixed_point` (at most ``iterations`` Newton rounds); a residual
    above :data:`WARN_RESIDUAL` warns once with its value."""
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
    sub, residual = solve_fixed_point(base, w[:, present], ratio, iterations)
    if iterations and residual > WARN_RESIDUAL:
        warnings.warn(f"label-shift pool: the fixed point did not settle in {iterations} rounds (the residual, the "
                      f"largest move of a probability under one more round, is {residual:.2g}); raise `iterations`",
                      stacklevel=2)
    q = torch.zeros(client_probs.shape[1], counts.shape[1], dtype=torch.float64)
    q[:, present] = sub
    if target_prior is not None:
        target = target_prior.double() / target_prior.double().sum()
        q = q * torch.where(present, target / prior.clamp_min(1e-300), torch.zeros_like(target))
        q = q / q.sum(-1, keepdim=True).clamp_min(1e-300)
    return q


def solve_fixed_point(base: torch.Tensor, w: torch.Tensor, ratio: torch.Tensor,
                      rounds: int = ITERATIONS) -> tuple[torch.Tensor, float]:
    """The pool's fixed point (module doc) for every row at once: ``base`` ``(n, P)`` (log prior plus the weighted
    evidence, P the classes some client saw), ``w`` ``(C, P)`` the per-class weights (summing to 1 over the
    clients), ``ratio`` ``(C, P)`` the clients' prior ratios ``π_c / π``.

    The map depends on q only through the clients' ``a_c = Σ_y ratio_c(y) q(y)``, so the iteration runs in
    ``v = log a`` ``(n, C)``: ``q(v) = softmax(base + v W)``, one round ``v ← log(q(v) Rᵀ)``, from ``a_c = 1``. Each
    row stops on its own once one more round moves none of its probabilities by more than :data:`TOLERANCE`;
    only the rows still moving take the next round (at most ``rounds``). The map can have more than one fixed
    point: the plain iteration from ``a_c = 1`` is the one that reaches the exact posterior on exact clients,
    where extrapolations (SQUAREM, Newton) were measured to jump to another. Returns ``(q (n, P), the largest
    residual)``, float64."""
    n, P = base.shape
    if n == 0:
        return torch.softmax(base, -1), 0.0
    q = torch.softmax(base, -1)
    move = torch.full((n,), math.inf, dtype=torch.float64)
    idx = torch.arange(n)
    for _ in range(rounds):
        log_a = (q[idx] @ ratio.T).clamp_min(1e-300).log()
        new_q = torch.softmax(base[idx] + log_a @ w, -1)
        step = (new_q - q[idx]).abs().amax(-1)
        q[idx], move[idx] = new_q, step
        idx = idx[step > TOLERANCE]
        if len(idx) == 0:
            break
    return q, float(move.max()) if rounds else 0.0


def capped_counts(class_counts: torch.Tensor, cap: float = COUNT_CAP) -> tuple[torch.Tensor, list[int]]:
    """``(C, classes)`` counts with every client's row scaled so its total is at most ``cap`` × the median
    total, and the clients that were scaled."""
    counts = class_counts.double()
    totals = counts.sum(1)
    scale = torch.clamp(cap * totals.median() / totals.clamp_min(1e-300), max=1.0)
    return counts * scale[:, None], [c for c in range(len(scale)) if scale[c] < 1.0]


def disagreement(client_probs: torch.Tensor, class_counts: torch.Tensor, smoothing: float = 0.5,
                 iterations: int = ITERATIONS) -> torch.Tensor:
    """Per client ``(C,)``: the mean total-variation distance, over the inputs and the classes the client
    claims, between its own predictive moved to the pooled label prior and the label-shift pool of the
    others (leave one out)."""
    C = client_probs.shape[0]
    counts = class_counts.double()
    prior = counts.sum(0) / counts.sum()
    scores = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the others' pools drift as the full pool does; it warns once itself
        for c in range(C):
            others = [k for k in range(C) if k != c]
            pool = label_shift_pool(client_probs[others], counts[others], smoothing, iterations)
            own_prior = counts[c] / counts[c].sum()
            own = client_probs[c].double() * torch.where(own_prior > 0, prior / own_prior.clamp_min(1e-300),
                                                         torch.zeros_like(prior))
            own = own / own.sum(-1, keepdim=True).clamp_min(1e-300)
            claimed = counts[c] > 0
            scores.append(0.5 * (own[:, claimed] - pool[:, claimed]).abs().sum(-1).mean())
    return torch.stack(scores)


def robust_label_shift_pool(client_probs: torch.Tensor, class_counts: torch.Tensor, smoothing: float = 0.5,
                            iterations: int = ITERATIONS, target_prior: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`label_shift_pool` resisting one lying client (module doc, ``robust``): count claims capped,
    then a client that predicts unlike the others on the classes it claims left out; each named in a
    warning (client indices in the artifact's order)."""
    counts, capped = capped_counts(class_counts)
    if capped:
        warnings.warn(f"label-shift pool (robust): client(s) {', '.join(map(str, capped))} claim more than "
                      f"{COUNT_CAP:g}x the clients' median count; their counts are scaled down to it", stacklevel=2)
    keep = list(range(client_probs.shape[0]))
    if client_probs.shape[0] >= 3 and client_probs.shape[1] >= SCREEN_ROWS:
        scores = disagreement(client_probs, counts, smoothing, iterations)
        median = scores.median()
        spread = (scores - median).abs().median().clamp_min(1e-6)
        out = [c for c in keep if scores[c] > median + SCREEN_MADS * spread]
        if out and len(out) < len(keep) / 2:
            warnings.warn(f"label-shift pool (robust): client(s) {', '.join(map(str, out))} predict unlike the "
                          f"others on the classes they claim (disagreement {', '.join(f'{float(scores[c]):.3g}' for c in out)}"
                          f" against a median of {float(median):.3g}); left out of this prediction", stacklevel=2)
            keep = [c for c in keep if c not in out]
    return label_shift_pool(client_probs[keep], counts[keep], smoothing, iterations, target_prior)


def client_groups(members_per_client: Sequence[int]) -> tuple[int, ...]:
    """``groups`` for members stored client after client: ``(0, 0, 1, 1, 1, …)``."""
    return tuple(c for c, m in enumerate(members_per_client) for _ in range(m))
