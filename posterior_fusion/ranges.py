"""The accepted range of every number a user or a file can set, declared once.

A value outside its range (NaN and infinities included) is refused with one line naming the
setting; the artifact reader uses the same ranges for what a file declares.
"""

from __future__ import annotations

import math

from posterior_fusion.errors import ConfigError

TEMPERATURE = (1e-6, 1e6)          # T
PRIOR_PRECISION = (1e-8, 1e8)      # λ0 = 1 / σ0²
PRIOR_VAR = (1e-8, 1e8)            # σ0²
PREDICTIVE_SCALE = (1e-8, 1e4)     # multiplier of the posterior covariance in a predictive
SAMPLES = (1, 10_000)              # Monte-Carlo samples per mode
BINS = (1, 10_000)                 # calibration bins
EPOCHS = (0, 100_000)
BATCH_SIZE = (1, 1_000_000)
LEARNING_RATE = (1e-12, 1e3)
SEED = (0, 2**63 - 1)             # every random seed
CLIENTS = (1, 10_000)              # client silos of a partition or a demo
ALPHA = (1e-6, 1e6)                # Dirichlet concentration α
JOBS = (1, 256)                    # parallel processes
COMPONENTS = (1, 256)              # mixture components M (the artifact format's cap)
STEPS = (0, 1_000_000)             # server optimisation steps
N_DATA = (1, 10**9)                # training examples of one client (its class counts are within it)
REFRESH_DAMPING = (0.0, 1e6)        # the refresh round's per-sample damping d
TRUST_RADIUS = (1e-6, 1e6)         # the refresh round's bound on a member's distance from the silo's own posterior
POOLING_SMOOTHING = (1e-6, 1e6)    # s added to every class count by the label-shift pooling
POOLING_ITERATIONS = (1, 100000)   # the label-shift pooling's fixed-point rounds at most


def is_int(value: object) -> bool:
    """An integer that is not a boolean (what a JSON count or index must be)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check(name: str, value: float | int, bounds: tuple[float, float]) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a finite number in ``bounds`` (inclusive)."""
    lo, hi = bounds
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and lo <= value <= hi
    if not ok:
        shown_name = f"`{name}`" if name.isidentifier() else name  # a setting: the CLI shows its flag
        raise ConfigError(f"{shown_name} must be a finite number in [{lo:g}, {hi:g}], got {str(value)[:40]}")
