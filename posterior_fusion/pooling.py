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
      w_c(y) = (n_c(y) + s) / Σ_c' (n_c'(y) + s),   π_c(y) ∝ n_c(y) + s,   π(y) ∝ Σ_c n_c(y) + s,

  from the class counts ``n_c(y)`` every client artifact records (``s``: ``smoothing``). When every
  client's predictive is its exact Bayes posterior the global posterior is a fixed point whatever
  the weights (each ``ρ̂_c = ρ``); a client that never saw class ``y`` gets almost no say on it. The
  iteration starts from ``a_c = 1`` and stops when no probability moves by more than ``1e-7`` (at
  most ``iterations`` rounds; on the Fashion-MNIST clients it settles in under ten).

Shapes: member probabilities ``(K, n, classes)``; the result ``(n, classes)`` (float64).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posterior_fusion import ranges
from posterior_fusion.errors import ConfigError

POOLINGS = ("average", "label-shift")
TOLERANCE = 1e-7


@dataclass(frozen=True)
class Pooling:
    """The combination rule of a global artifact (metadata field ``pooling``).

    ``groups[k]``: the client of member ``k``; ``class_counts[c]``: client ``c``'s training
    examples per class (both for ``label-shift`` only)."""

    rule: str = "average"
    groups: tuple[int, ...] = ()
    class_counts: tuple[tuple[int, ...], ...] = ()
    smoothing: float = 0.5
    iterations: int = 100
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
        if set(raw) != fields:
            raise ConfigError(f"{where}: {raw['rule']} needs exactly the fields {', '.join(sorted(fields))}")
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
        out = cls(raw["rule"], tuple(groups), tuple(tuple(r) for r in counts), float(smoothing), iterations, where)
        out.validate(num_members, num_classes)
        return out

    def to_metadata(self) -> dict:
        if self.rule == "average":
            return {"rule": "average"}
        return {"rule": self.rule, "groups": list(self.groups), "class_counts": [list(r) for r in self.class_counts],
                "smoothing": self.smoothing, "iterations": self.iterations}

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
        return label_shift_pool(per_client, torch.tensor(self.class_counts, dtype=torch.float64), self.smoothing,
                                self.iterations)


AVERAGE = Pooling()


def label_shift_pool(client_probs: torch.Tensor, class_counts: torch.Tensor, smoothing: float = 0.5,
                     iterations: int = 100) -> torch.Tensor:
    """The ``label-shift`` pooling (module doc) of the clients' predictives ``client_probs``
    ``(C, n, classes)`` with their class counts ``(C, classes)``; returns ``q`` ``(n, classes)``, float64."""
    p = client_probs.double().clamp_min(1e-300)
    counts = class_counts.double() + smoothing
    prior_c = counts / counts.sum(1, keepdim=True)              # π_c(y)    (C, classes)
    prior = counts.sum(0) / counts.sum()                        # π(y)      (classes,)
    w = counts / counts.sum(0, keepdim=True)                    # w_c(y), Σ_c w_c(y) = 1
    base = prior.log() + (w[:, None, :] * (p.log() - prior_c.log()[:, None, :])).sum(0)   # (n, classes)
    q = torch.softmax(base, -1)
    for _ in range(iterations):
        log_a = torch.einsum("cy,ny->cn", prior_c / prior, q).log()   # log a_c(x)  (C, n)
        new = torch.softmax(base + torch.einsum("cy,cn->ny", w, log_a), -1)
        moved = (new - q).abs().max().item()
        q = new
        if moved < TOLERANCE:
            break
    return q


def client_groups(members_per_client: Sequence[int]) -> tuple[int, ...]:
    """``groups`` for members stored client after client: ``(0, 0, 1, 1, 1, …)``."""
    return tuple(c for c, m in enumerate(members_per_client) for _ in range(m))
