"""The experiment grid configuration (``pfuse experiment CONFIG.toml``): every list is an axis."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import tomllib

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion import METHODS
from posterior_fusion.local.config import STRUCTURES

# Deprecated TOML keys kept for one release: old -> new.
RENAMED_KEYS = {"mixtures": "components"}


@dataclass(frozen=True)
class ExperimentConfig:
    """A grid; every list is an axis. See benchmarks/*.toml for examples.

    ``seeds`` are run seeds: for run seed s the partition, init and training seeds all equal s.
    """

    name: str = "experiment"
    data: str = "system"              # "system" (Debian FMNIST, else embedded) or "embedded"
    max_train: int | None = None      # cap on training samples (smoke runs)
    alphas: list[float] = field(default_factory=lambda: [0.1])
    clients: list[int] = field(default_factory=lambda: [5])
    seeds: list[int] = field(default_factory=lambda: [0])
    components: list[int] = field(default_factory=lambda: [5])
    structures: list[str] = field(default_factory=lambda: ["kron"])
    methods: list[str] = field(default_factory=lambda: ["fedbens", "fedfisher", "regmean", "fisher-merge", "fedavg"])
    model: str = "lenet"
    epochs: int = 20
    steps: int = 300                  # server Adam steps of the optimising methods
    temperature: float = 0.1
    prior_var: float = 0.1
    val_size: int = 500
    protocol: str = "ours"            # or "fedbens-reference" (the authors' partition; see pfuse partition --help)
    temperatures: list[float] = field(default_factory=list)  # server re-tempering sweep for fedbens
    tune: bool = False                # fedbens with T and prior chosen on validation ("fedbens-tuned")
    tune_temperatures: list[float] = field(default_factory=lambda: [0.01, 0.03, 0.1, 0.3, 1.0])
    tune_prior_vars: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0])
    centralized: bool = True          # pooled-data upper bound
    share_training: bool = True       # structures after the first recapture its trained components (pfuse recapture)

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> ExperimentConfig:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read config ({exc})") from None
        for old, new in RENAMED_KEYS.items():
            if old in raw:
                print(f"warning: {path}: key {old!r} is deprecated; use {new!r}", file=sys.stderr)
                raw.setdefault(new, raw.pop(old))
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        try:
            cfg = cls(**raw)
        except TypeError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        cfg.validate(path)
        return cfg

    def validate(self, where: str | os.PathLike = "config") -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ConfigError(f"{where}: unknown methods {bad}; available: {list(METHODS)}")
        if self.data not in ("system", "embedded"):
            raise ConfigError(f"{where}: data must be 'system' or 'embedded'")
        if [s for s in self.structures if s not in STRUCTURES]:
            raise ConfigError(f"{where}: structures must be among {STRUCTURES}")
        if not all(a > 0 for a in self.alphas) or not all(m >= 1 for m in self.components) or not self.seeds:
            raise ConfigError(f"{where}: alphas must be > 0, components >= 1, seeds non-empty")
        if self.protocol not in ("ours", "fedbens-reference"):
            raise ConfigError(f"{where}: protocol must be 'ours' or 'fedbens-reference'")
        if self.epochs < 0 or self.steps < 0 or not self.temperature > 0 or not self.prior_var > 0:
            raise ConfigError(f"{where}: epochs and steps must be >= 0, temperature and prior_var > 0")
