"""The experiment grid configuration (``pfuse experiment CONFIG.toml``): every list is an axis."""

from __future__ import annotations

import math
import os
import re
import sys
import typing
from dataclasses import dataclass, fields

import tomllib

from posterior_fusion import ranges
from posterior_fusion.choices import STRUCTURES, Choice, Protocol
from posterior_fusion.compat import RENAMED_TOML_KEYS, rename_keys
from posterior_fusion.errors import ConfigError, DataError, ModelSpecError, shown
from posterior_fusion.files import require_regular_file
from posterior_fusion.fusion.registry import COMPARED, METHODS
from posterior_fusion.local.fit_config import FitConfig, fit_config_from
from posterior_fusion.local.start_settings import StartSettings
from posterior_fusion.runtime import resolve_device
from posterior_fusion.settings import declared_default, setting

MAX_CONFIG_BYTES = 1_000_000
MAX_AXIS = 64
MAX_CELLS = 100_000
NAME_RE = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._-]{1,100}")


def _check_types(raw: dict, where: str | os.PathLike) -> None:
    """Every key of the TOML file has its field's type (lists of the element type), no NUL in text."""
    hints = typing.get_type_hints(ExperimentConfig)
    for key, value in raw.items():
        tp = hints[key]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is list:
            ok = isinstance(value, list) and all(_is(v, args[0]) for v in value)
        elif type(None) in args:
            ok = value is None or _is(value, next(a for a in args if a is not type(None)))
        else:
            ok = _is(value, tp)
        if not ok:
            raise ConfigError(f"{where}: key {key!r} must be {getattr(tp, '__name__', str(tp))}, got {shown(value, 60)}")


def _is(value, tp) -> bool:
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str) and "\x00" not in value and len(value) <= 1000
    return isinstance(value, tp)




class DataSource(Choice):
    """Which Fashion-MNIST a grid reads."""

    SYSTEM = "system", "Debian's dataset-fashion-mnist (else the embedded subset)"
    EMBEDDED = "embedded", "the subset embedded in data/"


@dataclass(frozen=True)
class ExperimentConfig:
    """A grid; every list is an axis. See experiments/*/config.toml for examples.

    ``seeds`` are run seeds: for run seed s the partition, init and training seeds all equal s.
    """

    name: str = setting("experiment", "The grid's name: one folder name under --out-dir.")
    data: str = setting("system", "Which Fashion-MNIST the grid reads.", choices=DataSource)
    max_train: int | None = setting(None, "A cap on the training samples (smoke runs) [default: none].")
    alphas: list[float] = setting([0.1], "Axis: Dirichlet concentrations α of the partition.")
    clients: list[int] = setting([5], "Axis: client counts C.")
    seeds: list[int] = setting([0], "Axis: run seeds; for run seed s the partition, init and training seeds all "
                                    "equal s.")
    components: list[int] = setting([declared_default(StartSettings, "components")],
                                    "Axis: mixture components M per client.")
    structures: list[str] = setting(["kron"], "Axis: curvature structures (kron, diag, diag+full).")
    methods: list[str] = setting(list(COMPARED), "The fusion methods compared (rows).")
    model: str = setting(declared_default(StartSettings, "model"), "The model every client trains (fit-local --model).")
    model_kwargs: dict = setting({}, "JSON keyword arguments of the model, e.g. {in_channels = 1}.")
    epochs: int = setting(20, "Local training epochs per component.")
    steps: int = setting(300, "Server Adam steps of the optimising methods.")
    temperature: float = setting(0.1, "Likelihood temperature T of every client.")
    prior_var: float = setting(0.1, "Prior variance σ0² of every client.")
    val_size: int = setting(500, "Server validation samples held out of the training set.")
    unlabeled_size: int = setting(0, "Training samples held out, unlabeled, as the server's data (FedBE, FedPPD, "
                                     "distill).")
    distill: list[str] = setting([], "Methods or variants also distilled into one model on the unlabeled data "
                                     "(rows '<name>+distill').")
    variants: dict = setting({}, "[variants] label = {method = \"fedbens\", <its settings>...}: extra rows.")
    protocol: str = setting("ours", "The partition protocol.", choices=Protocol)
    temperatures: list[float] = setting([], "A server re-tempering sweep of the tunable methods.")
    tune: bool = setting(False, "The tunable methods also with T and σ0² chosen on validation (rows "
                                "'<method>-tuned').")
    tune_temperatures: list[float] = setting([0.01, 0.03, 0.1, 0.3, 1.0], "The grid of T for tune.")
    tune_prior_vars: list[float] = setting([0.01, 0.1, 1.0], "The grid of σ0² for tune.")
    centralized: bool = setting(True, "Also the pooled-data upper bound (one network trained on every silo).")
    share_training: bool = setting(True, "Structures after the first recapture its trained components (pfuse "
                                         "recapture) instead of training again.")
    fit: dict = setting({}, "[fit] table: any other fit setting of fit-local, by its name.")

    @property
    def spec(self):
        """The grid's model."""
        from posterior_fusion.models import ModelSpec

        return ModelSpec(self.model, dict(self.model_kwargs))

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> ExperimentConfig:
        try:
            source = require_regular_file(path, "experiment config")
            if source.stat().st_size > MAX_CONFIG_BYTES:
                raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not an experiment config")
            raw = tomllib.loads(source.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, DataError) as exc:
            raise ConfigError(f"{path}: cannot read config ({exc})") from None
        raw = rename_keys(raw, RENAMED_TOML_KEYS, str(path), lambda msg: print(msg, file=sys.stderr))
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        _check_types(raw, path)
        cfg = cls(**raw)
        cfg.validate(path)
        return cfg

    def validate(self, where: str | os.PathLike = "config") -> None:
        from posterior_fusion.fusion import method_settings  # the settings records: when a config is read

        if not NAME_RE.fullmatch(self.name):
            raise ConfigError(f"{where}: name {shown(self.name)} must be one folder name (letters, digits, '.', '_', "
                              "'-'; not '.' or '..'), at most 100 characters")
        axes = [self.alphas, self.clients, self.seeds, self.components, self.structures, self.methods,
                self.temperatures, self.tune_temperatures, self.tune_prior_vars]
        if max(len(a) for a in axes) > MAX_AXIS or math.prod(max(1, len(a)) for a in axes[:6]) > MAX_CELLS:
            raise ConfigError(f"{where}: the grid is too large (at most {MAX_AXIS} values per axis and "
                              f"{MAX_CELLS} fusion cells)")
        for name, values, bounds in (("clients", self.clients, (1, 1000)), ("components", self.components, ranges.COMPONENTS),
                                     ("alphas", self.alphas, (1e-6, 1e6)), ("temperatures", self.temperatures, ranges.TEMPERATURE),
                                     ("tune_temperatures", self.tune_temperatures, ranges.TEMPERATURE),
                                     ("tune_prior_vars", self.tune_prior_vars, ranges.PRIOR_VAR),
                                     ("seeds", self.seeds, (0, 2**32 - 1))):
            for v in values:
                ranges.check(f"{where}: {name}", v, bounds)
        ranges.check(f"{where}: epochs", self.epochs, ranges.EPOCHS)
        ranges.check(f"{where}: steps", self.steps, ranges.STEPS)
        ranges.check(f"{where}: temperature", self.temperature, ranges.TEMPERATURE)
        ranges.check(f"{where}: prior_var", self.prior_var, ranges.PRIOR_VAR)
        ranges.check(f"{where}: val_size", self.val_size, (0, 1_000_000))
        ranges.check(f"{where}: unlabeled_size", self.unlabeled_size, (0, 10_000_000))
        if self.tune and not self.val_size:
            raise ConfigError(f"{where}: tune needs server validation data: set val_size > 0")
        if self.distill and not self.unlabeled_size:
            raise ConfigError(f"{where}: distill needs unlabeled server data: set unlabeled_size")
        for label, spec in self.variants.items():
            if not NAME_RE.fullmatch(label) or label in METHODS:
                raise ConfigError(f"{where}: variant {shown(label)} must be a new row name (letters, digits, '.', "
                                  "'_', '-'), not a method's")
            if not isinstance(spec, dict) or spec.get("method") not in METHODS:
                raise ConfigError(f"{where}: variant {label!r} needs method = one of {list(METHODS)}")
            method_settings(spec["method"], {k: v for k, v in spec.items() if k != "method"})  # names, types, ranges
        bad = [m for m in self.distill if m not in self.methods and m not in self.variants]
        if bad:
            raise ConfigError(f"{where}: distill names {bad}, which are not among methods {self.methods} "
                              f"or variants {list(self.variants)}")
        if self.max_train is not None:
            ranges.check(f"{where}: max_train", self.max_train, (1, 10_000_000))
        own = {"structure", "temperature", "prior_var", "train_seed", "epochs"}  # set by the grid's own keys
        if own & set(self.fit):
            raise ConfigError(f"{where}: [fit] may not set {sorted(own & set(self.fit))}: the grid's own keys do")
        fit_config_from({k: v for k, v in self.fit.items()}, f"{where}: [fit] ")  # names, types and ranges
        resolve_device(str(self.fit.get("device", declared_default(FitConfig, "device"))), f"{where}: [fit] device")  # before any partition
        try:
            _ = self.spec
        except ModelSpecError as exc:
            raise ConfigError(f"{where}: model / model_kwargs: {exc}") from None
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
