"""One fit configuration: what ``pfuse fit-local``, the Flower ClientApp, the demo and the
experiment runner all build (defaults live here and nowhere else)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from posterior_fusion import ranges
from posterior_fusion.errors import ConfigError
from posterior_fusion.local.capture import CAPTURE, CAPTURE_METHODS, GGN_TYPES
from posterior_fusion.local.ppd import PPDConfig

STRUCTURES = tuple(CAPTURE)  # curvature structures a silo can capture (local/capture.py)


def auto_weight_decay(temperature: float, prior_precision: float, n_data: int) -> float:
    """SGD weight decay ``T·λ0/n`` that makes the trained weights the tempered-posterior MAP:
    the mean loss ``L/n`` plus ``½(T·λ0/n)‖w‖²`` is ``T/n`` times ``L/T + ½λ0‖w‖²``."""
    return temperature * prior_precision / n_data


@dataclass(frozen=True)
class TrainConfig:
    """SGD settings. ``weight_decay=None``: :func:`auto_weight_decay` (resolved per silo)."""

    epochs: int = 20
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float | None = None
    swag: bool = False
    swag_epochs: int = 0          # last epochs over which SWAG snapshots are taken (0: max(1, E//4))
    swag_snapshots_per_epoch: int = 4
    swag_rank: int = 20           # K deviation columns kept

    def validate(self) -> None:
        ranges.check("epochs", self.epochs, ranges.EPOCHS)
        ranges.check("batch_size", self.batch_size, ranges.BATCH_SIZE)
        ranges.check("lr", self.lr, ranges.LEARNING_RATE)
        ranges.check("swag_rank", self.swag_rank, (1, 256))
        for ok, message in ((self.epochs >= 0, f"--epochs must be >= 0, got {self.epochs}"),
                            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
                            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
                            (0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}")):
            if not ok:
                raise ConfigError(message)
        if self.weight_decay is not None and not self.weight_decay >= 0:
            raise ConfigError("`weight_decay` must be >= 0 (or omitted for T·λ0/n)")
        if self.swag_rank < 1 or self.swag_epochs < 0 or self.swag_snapshots_per_epoch < 1:
            raise ConfigError("`swag_rank` must be >= 1 (swag_epochs >= 0, swag_snapshots_per_epoch >= 1)")


@dataclass(frozen=True)
class PrivateModelConfig:
    """HBFL's heterogeneous client: the silo's own architecture (never written to the artifact),
    trained first and distilled on the silo's data into the shared model (``weight``: the
    weight of the distillation term, HBFL's 1 − α; ``epochs`` None: the shared model's epochs)."""

    model: str
    model_kwargs: dict = field(default_factory=dict)
    epochs: int | None = None
    weight: float = 0.5

    def validate(self) -> None:
        if not 0 <= self.weight <= 1:
            raise ConfigError(f"`private_weight` must be in [0, 1], got {self.weight}")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"`private_epochs` must be >= 1, got {self.epochs}")


@dataclass(frozen=True)
class FitConfig:
    """Everything that determines a silo's fit besides the data, the model and the starting points."""

    structure: str = "kron"
    temperature: float = 0.1
    prior_var: float = 0.1
    train_seed: int = 0
    curvature_batch_size: int = 256
    ggn: str = "exact"            # "exact" GGN or "mc" (Monte-Carlo Fisher, 1 sample)
    capture: str = "fast"         # "fast" (local/fastcapture.py, where the model allows) or "laplace"
    ppd: PPDConfig | None = None  # FedPPD: also distil an SGLD chain per component into a student (local/ppd.py)
    private: PrivateModelConfig | None = None  # HBFL: the silo's own architecture, distilled into the shared one
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        if self.structure not in STRUCTURES:
            raise ConfigError(f"unknown curvature structure {self.structure!r}; use one of {', '.join(STRUCTURES)}")
        if self.ggn not in GGN_TYPES:
            raise ConfigError(f"unknown GGN type {self.ggn!r}; use 'exact' or 'mc'")
        ranges.check("temperature", self.temperature, ranges.TEMPERATURE)
        ranges.check("prior_var", self.prior_var, ranges.PRIOR_VAR)
        ranges.check("curvature_batch_size", self.curvature_batch_size, ranges.BATCH_SIZE)
        if self.capture not in CAPTURE_METHODS:
            raise ConfigError(f"unknown `capture` {self.capture!r}; use one of {', '.join(CAPTURE_METHODS)}")
        if self.ppd is not None:
            self.ppd.validate()
        if self.private is not None:
            self.private.validate()
        if self.curvature_batch_size < 1:
            raise ConfigError("`curvature_batch_size` must be >= 1")
        self.train.validate()

    @property
    def prior_precision(self) -> float:
        """λ0 = 1/σ0²."""
        return 1.0 / self.prior_var

    def fingerprint_dict(self) -> dict:
        """The settings that determine the result: ``capture`` (fast or laplace-torch, equal at
        rounding level) is left out, and ``ppd`` when off, so caches and partial files written
        before these options existed keep their keys."""
        out = {k: v for k, v in asdict(self).items() if k != "capture"}
        for optional in ("ppd", "private"):
            if out[optional] is None:
                out.pop(optional)
        return out

    def resolved(self, n_data: int) -> FitConfig:
        """A copy with the automatic weight decay filled in for a silo of ``n_data`` samples."""
        if self.train.weight_decay is not None:
            return self
        wd = auto_weight_decay(self.temperature, self.prior_precision, n_data)
        return replace(self, train=replace(self.train, weight_decay=wd))
