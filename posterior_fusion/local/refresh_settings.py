"""The refresh round's settings (``pfuse refresh``, Flower's refresh handler), declared once and free of torch:
the damping of the step to each centre, the trust radius and the private release (:class:`RefreshPrivacy`)."""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from posterior_fusion import ranges
from posterior_fusion.errors import ConfigError, shown
from posterior_fusion.settings import check_declared, convert, setting

# the refresh round's centre step: its damping chosen per mode by the silo's gain ratio (recapture's docstring;
# measured against fixed dampings by experiments/without_validation/refresh_round.py)
REFRESH_DAMPING: float | str = "auto"
AUTO_DAMPINGS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)  # ``damping="auto"`` tries these, smallest first
TRUST_RADIUS = 4.0  # a member's per-parameter squared distance from the silo's own posterior, at most (:mod:`posterior_fusion.local.refresh`'s docstring)
RATIO_FLOOR = 0.25  # ... and keeps the first whose step the silo's loss confirms this well (:mod:`posterior_fusion.local.refresh`'s docstring)
PRIVATE_REFRESH_DAMPING = 1.0
"""The damping of a private refresh round when ``damping`` is auto: auto would choose it on the silo's own loss
at each candidate centre, a release the accountant does not count; a fixed number needs no data."""


def check_damping(value: object, name: str = "damping") -> float | str:
    """The refresh round's damping as given (CLI text, TOML, a Flower message): ``"auto"`` or a finite
    number >= 0 (returned as float); anything else raises ConfigError naming ``name``."""
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    lo, hi = ranges.REFRESH_DAMPING
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and lo <= value <= hi):
        raise ConfigError(f"{name} must be 'auto' or a finite number in [{lo:g}, {hi:g}], got {shown(value, 40)}")
    return float(value)


@dataclass(frozen=True)
class RefreshStep:
    """How a refresh round moves each component to a global member (:mod:`posterior_fusion.local.refresh`): the
    damping of the Gauss-Newton step and the trust radius that refuses a global too far from the silo's own
    posterior."""

    damping: str = setting(
        REFRESH_DAMPING,
        "Per-sample damping d of the step from each member to the component's centre (Levenberg-Marquardt; "
        "Kronecker blocks (B + n d I) x (A + d I)); 0: the plain Gauss-Newton centre, which overshoots; auto: per "
        f"member, the smallest d of {', '.join(f'{d:g}' for d in AUTO_DAMPINGS)} whose step the silo's own loss "
        f"confirms (gain ratio >= {RATIO_FLOOR}; one forward pass per d tried; a private round, which cannot "
        f"consult the loss, takes {PRIVATE_REFRESH_DAMPING:g}).")
    trust_radius: float = setting(
        TRUST_RADIUS,
        "Refuse a global whose member lies farther than this from the silo's own posterior (squared distance per "
        "parameter in its own precision, min over its components; a draw from it averages 1): a server-chosen "
        "point far from it can make the reply reveal training data.", bounds=ranges.TRUST_RADIUS)

    def validate(self) -> None:
        check_declared(self)
        check_damping(self.damping, "`damping`")

    @property
    def damping_value(self) -> float | str:
        """``"auto"`` or the damping as a number."""
        return check_damping(self.damping)


@dataclass(frozen=True)
class RefreshPrivacy:
    """What the refresh round releases at the server's points (:mod:`posterior_fusion.local.recapture`, "A
    private refresh"): with ``refresh_dp_epsilon`` set (the default), one Gaussian mechanism per global member
    on the silo's per-sample-clipped gradient there, composed by Opacus' RDP accountant into
    (``refresh_dp_epsilon``, ``refresh_dp_delta``); the curvature is the silo's own, already released. None:
    the gradient and a new curvature at the server's points, released as they are — a point built to leak
    (a binning trap) then rebuilds training images from them (docs/security.md)."""

    refresh_dp_epsilon: float | None = setting(
        1.0, "The refresh round's privacy: ε of its release (the gradient at each global member, clipped per "
             "sample, Gaussian noise; composed over the members; the curvature stays the artifact's own); none: "
             "no mechanism, a new curvature and the exact gradient at the server's points (only for a server you "
             "trust: a point built to leak rebuilds training images from them).", bounds=(1e-3, 1e3))
    refresh_dp_delta: float | None = setting(None, "δ of the refresh round's release [default: 1/n, n the silo's size].",
                                             bounds=(1e-12, 0.1))
    refresh_dp_clip: float = setting(10.0, "Per-sample gradient norm bound of the refresh round's release (its L2 "
                                          "sensitivity).", bounds=(1e-6, 1e6))

    def validate(self) -> None:
        check_declared(self)

    @property
    def private(self) -> bool:
        return self.refresh_dp_epsilon is not None


def refresh_privacy_from(values: Mapping[str, Any], where: str = "") -> RefreshPrivacy:
    """A validated :class:`RefreshPrivacy` from settings given as text or values (CLI, a Flower node config;
    names as declared, those not given at their defaults)."""
    hints = typing.get_type_hints(RefreshPrivacy)
    known = {f.name for f in fields(RefreshPrivacy)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}no refresh setting {', '.join(map(repr, unknown))}; they are: {', '.join(sorted(known))}")
    given = {k: convert(v, hints[k], k, where.rstrip(": ")) for k, v in values.items()}
    out = RefreshPrivacy(**given)
    out.validate()
    return out


PRIVATE_REFRESH = RefreshPrivacy()  # the refresh round's default: private
