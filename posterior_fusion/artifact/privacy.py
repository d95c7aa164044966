"""The privacy records of a client artifact (``dp``, ``refreshed_at``) read as a schema, and checked against
what they claim.

A record is untrusted JSON like every header field: :func:`check_privacy_records` refuses, before anything reads
it, a record of the wrong shape (types, ranges: ε > 0, δ in (0, 1), a list of passes), and a ``dp`` record on
an artifact whose own contents a private fit never writes (the data's SHA-256; a component's loss, accuracy or
timings). :func:`recorded_epsilon_problem` recomputes the recorded ε from the recorded mechanisms with Opacus'
Rényi-DP accountant — the same computation that calibrated them (``local/privacy/accounting.py`` builds on the
functions here) — and says what disagrees; without Opacus the guarantee can only be *claimed*.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from posterior_fusion.artifact.jsonattr import HeaderProblem, _is_int, _is_number

PRIVATE_NEVER_WRITTEN = ("data_sha256",)                                   # metadata a private fit never records
PRIVATE_NEVER_TRAINED = ("final_loss", "final_accuracy", "train_seconds", "curvature_seconds")  # per component


def orders(coarse: bool = False) -> list[float]:
    """Opacus' RDP orders; ``coarse``: only the integer ones (thirty times cheaper for a subsampled mechanism, and
    an ε at least as large)."""
    from opacus.accountants.rdp import RDPAccountant

    return [a for a in RDPAccountant.DEFAULT_ALPHAS if not coarse or float(a).is_integer()]


def rdp(noise_multiplier: float, sample_rate: float, steps: int, coarse: bool = False):
    """The Rényi DP of ``steps`` subsampled Gaussian steps (Opacus' ``compute_rdp``) on :func:`orders`."""
    from opacus.accountants.analysis.rdp import compute_rdp

    return compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=orders(coarse))


def epsilon_of(rdp_values, delta: float, coarse: bool = False) -> float:
    """ε at ``delta`` of composed Rényi DP values (Opacus' ``get_privacy_spent``)."""
    from opacus.accountants.analysis.rdp import get_privacy_spent

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order")  # a bound at the largest order is still valid
        return float(get_privacy_spent(orders=orders(coarse), rdp=rdp_values, delta=delta)[0])


def _field(where: str, record: dict, name: str, kind: str, lo: float = -math.inf, hi: float = math.inf,
           open_lo: bool = False, optional: bool = False) -> Any:
    if name not in record:
        if optional:
            return None
        raise HeaderProblem("/", f"metadata field '{where}.{name}' missing")
    value = record[name]
    ok = {"int": _is_int, "number": _is_number, "str": lambda v: isinstance(v, str) and len(v) <= 400}[kind](value)
    if ok and kind != "str":
        ok = (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        bounds = "" if kind == "str" else f" in {'(' if open_lo else '['}{lo:g}, {hi:g}]"
        raise HeaderProblem("/", f"metadata field '{where}.{name}' must be {'an integer' if kind == 'int' else 'text' if kind == 'str' else 'a finite number'}"
                                 f"{bounds}, got {str(value)[:40]!r}")
    return value


def _check_dp(record: Any) -> None:
    if not isinstance(record, dict):
        raise HeaderProblem("/", "metadata field 'dp' must be an object (the privacy record of a private fit)")
    _field("dp", record, "epsilon", "number", 0, 1e6, open_lo=True)
    _field("dp", record, "delta", "number", 0, 1, open_lo=True)
    _field("dp", record, "noise_multiplier", "number", 0, 1e6, open_lo=True)
    _field("dp", record, "sample_rate", "number", 0, 1, open_lo=True)
    _field("dp", record, "steps", "int", 1, 1e12)
    _field("dp", record, "release_noise", "number", 0, 1e6, open_lo=True)
    _field("dp", record, "releases", "int", 1, 1e6)
    _field("dp", record, "clip", "number", 0, 1e12, open_lo=True)
    _field("dp", record, "curvature_clip", "number", 0, 1e12, open_lo=True)
    _field("dp", record, "target_epsilon", "number", 0, 1e6, open_lo=True, optional=True)
    _field("dp", record, "input_clip", "number", 0, 1e12, open_lo=True, optional=True)
    _field("dp", record, "training_share", "number", 0, 1, optional=True)
    for name in ("accountant", "mechanism", "opacus"):
        _field("dp", record, name, "str", optional=True)
    passes = record.get("passes", [])
    if not isinstance(passes, list) or len(passes) > 16:
        raise HeaderProblem("/", "metadata field 'dp.passes' must be a list of at most 16 pass records")
    for i, p in enumerate(passes):
        if not isinstance(p, dict) or set(p) != {"part", "sample_rate", "steps"}:
            raise HeaderProblem("/", f"metadata field 'dp.passes[{i}]' must hold exactly part, sample_rate, steps")
        _field(f"dp.passes[{i}]", p, "part", "str")
        _field(f"dp.passes[{i}]", p, "sample_rate", "number", 0, 1, open_lo=True)
        _field(f"dp.passes[{i}]", p, "steps", "int", 1, 1e12)


def _check_refresh(record: Any) -> None:
    if not isinstance(record, dict):
        raise HeaderProblem("/", "metadata field 'refreshed_at' must be an object (the refresh round's record)")
    _field("refreshed_at", record, "file_sha256", "str")
    _field("refreshed_at", record, "method", "str")
    _field("refreshed_at", record, "members", "int", 1, 1e6)
    damping = record.get("damping")
    if not (damping == "auto" or (_is_number(damping) and 0 <= damping <= 1e6)):
        raise HeaderProblem("/", f"metadata field 'refreshed_at.damping' must be a number in [0, 1e6] or 'auto', "
                                 f"got {str(damping)[:40]!r}")
    if "dp" in record:
        dp = record["dp"]
        if not isinstance(dp, dict):
            raise HeaderProblem("/", "metadata field 'refreshed_at.dp' must be an object")
        _field("refreshed_at.dp", dp, "epsilon", "number", 0, 1e6, open_lo=True)
        _field("refreshed_at.dp", dp, "delta", "number", 0, 1, open_lo=True)
        _field("refreshed_at.dp", dp, "noise_multiplier", "number", 0, 1e6, open_lo=True)
        _field("refreshed_at.dp", dp, "releases", "int", 1, 1e6)
        _field("refreshed_at.dp", dp, "clip", "number", 0, 1e12, open_lo=True)
        _field("refreshed_at.dp", dp, "epsilon_with_fit", "number", 0, 2e6, open_lo=True, optional=True)
        _field("refreshed_at.dp", dp, "delta_with_fit", "number", 0, 2, open_lo=True, optional=True)


def check_privacy_records(meta: dict[str, Any], trainings: list[Any]) -> None:
    """The ``dp`` and ``refreshed_at`` records of a client artifact's metadata, and a ``dp`` record's consistency
    with the artifact (``trainings``: each component's training record): one :class:`HeaderProblem` otherwise."""
    if "dp" in meta:
        _check_dp(meta["dp"])
        found = [k for k in PRIVATE_NEVER_WRITTEN if k in meta]
        found += [k for t in trainings if isinstance(t, dict) for k in PRIVATE_NEVER_TRAINED if k in t]
        if found:
            raise HeaderProblem("/", f"metadata field 'dp': the artifact holds {found[0]!r}, which a private fit never "
                                     "releases: the privacy record does not belong to this artifact")
    if "refreshed_at" in meta:
        _check_refresh(meta["refreshed_at"])
        if "dp" in meta and not isinstance(meta["refreshed_at"].get("dp"), dict):
            raise HeaderProblem("/", "metadata field 'refreshed_at': a private artifact refreshed without a private "
                                     "release (no 'refreshed_at.dp')")


def recorded_epsilon_problem(record: dict[str, Any]) -> str | None:
    """What disagrees between a (schema-checked) ``dp`` record's ε and the ε Opacus' accountant gives for its
    recorded mechanisms — the training steps and the other passes at ``noise_multiplier``, the ``releases`` full
    Gaussian releases at ``release_noise`` — or None; raises ImportError without Opacus (then it is claimed)."""
    values = rdp(record["noise_multiplier"], record["sample_rate"], record["steps"])
    for p in record.get("passes", []):
        values = values + rdp(record["noise_multiplier"], p["sample_rate"], p["steps"])
    values = values + rdp(record["release_noise"], 1.0, record["releases"])
    epsilon = epsilon_of(values, record["delta"])
    if not math.isclose(epsilon, record["epsilon"], rel_tol=1e-6):
        return (f"the recorded ε {record['epsilon']:.6g} is not what its recorded mechanisms give under Opacus' "
                f"accountant ({epsilon:.6g})")
    target = record.get("target_epsilon")
    if target is not None and epsilon > target * (1 + 1e-9):
        return f"the recorded mechanisms give ε {epsilon:.6g}, above the recorded target {target:g}"
    return None
