"""One fit configuration: what ``pfuse fit-local``, the Flower ClientApp, the demo and the
experiment runner all build (defaults live here and nowhere else)."""

from __future__ import annotations

import sys
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from posterior_fusion import ranges
from posterior_fusion.choices import (
    CAPTURE_DTYPES,
    FINETUNE_RE,
    BatchnormPolicy,
    CaptureDtype,
    CaptureMethod,
    CompressMetric,
    Device,
    GgnType,
    KfacType,
    Optimizer,
    Schedule,
    Structure,
    VectorDtype,
)
from posterior_fusion.compat import RENAMED_FIT_SETTINGS, rename_keys
from posterior_fusion.errors import ConfigError, shown
from posterior_fusion.settings import check_declared, convert, field_default, setting

if typing.TYPE_CHECKING:
    from posterior_fusion.curvature.compressed import Compression


def capture_dtype_problem(capture_dtype: str, method: str, fast_problem: str | None) -> str | None:
    """Why ``capture_dtype`` cannot be honoured (None when it can): a type other than float32 needs
    the fast capture (laplace-torch's backends run in the model's type). ``fast_problem``: why the fast
    capture cannot take the model (``models.layers.unsupported_reason``; None when it can)."""
    if capture_dtype not in CAPTURE_DTYPES:
        return f"unknown `capture_dtype` {capture_dtype!r}; use one of {', '.join(CAPTURE_DTYPES)}"
    if capture_dtype == "float32":
        return None
    if method != "fast":
        return f"`capture_dtype` {capture_dtype} needs the fast capture (`capture` fast), not laplace-torch"
    if fast_problem is not None:
        return f"`capture_dtype` {capture_dtype} needs the fast capture, which this model cannot use ({fast_problem})"
    return None


def auto_weight_decay(temperature: float, prior_precision: float, n_data: int) -> float:
    """SGD weight decay ``T·λ0/n`` that makes the trained weights the tempered-posterior MAP:
    the mean loss ``L/n`` plus ``½(T·λ0/n)‖w‖²`` is ``T/n`` times ``L/T + ½λ0‖w‖²``."""
    return temperature * prior_precision / n_data


@dataclass(frozen=True)
class TrainConfig:
    """Training settings: the optimiser and its schedule, the prior as weight decay (``weight_decay=None``:
    :func:`auto_weight_decay`, resolved per silo), SWAG. Every optimiser minimises the same objective — the
    mean cross-entropy plus ``½ wd ‖w − μ0‖²`` — so the MAP is the one the capture describes
    (``docs/methods.md``, "Optimisers")."""

    epochs: int = setting(20, "Local training epochs per component.", bounds=ranges.EPOCHS)
    batch_size: int = setting(64, "Training batch size.", bounds=ranges.BATCH_SIZE)
    optimizer: str = setting("sgd", "The optimiser (docs/methods.md, \"Optimisers\").", choices=Optimizer)
    lr: float = setting(0.01, "Learning rate (peak of the schedule).", bounds=ranges.LEARNING_RATE)
    momentum: float = setting(0.9, "SGD momentum (below 1); with adam and adamw Adam's β1.", bounds=(0.0, 0.999999))
    schedule: str = setting("constant", "Learning-rate schedule over the steps.", choices=Schedule)
    warmup_epochs: float = setting(0.0, "Linear warm-up of the learning rate from 0 over this many epochs.",
                                   bounds=(0.0, 1e6))
    grad_clip: float | None = setting(None, "Clip the gradient's global L2 norm (data term only) to this "
                                            "[default: no clipping].", bounds=(1e-12, 1e12))
    weight_decay: float | None = setting(None, "Weight decay toward the prior's centre [default: T·λ0/n, which "
                                               "makes the result the tempered-posterior MAP].", bounds=(0.0, 1e6))
    swag: bool = setting(False, "Also collect SWAG moments over the last epochs.")
    swag_epochs: int = setting(0, "Last epochs over which SWAG snapshots are taken (0: max(1, epochs // 4)).",
                                  bounds=ranges.EPOCHS)
    swag_snapshots_per_epoch: int = setting(4, "SWAG snapshots per epoch.", bounds=(1, 10_000))
    swag_rank: int = setting(20, "SWAG deviation columns K.", bounds=(1, 256))

    def validate(self) -> None:
        check_declared(self)
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
class LocalModelConfig:
    """HBFL's heterogeneous client: the silo's own architecture (never written to the artifact),
    trained first and distilled on the silo's data into the shared model (``weight``: the
    weight of the distillation term, HBFL's 1 − α; ``epochs`` None: the shared model's epochs)."""

    model: str | None = setting(None, "HBFL's heterogeneous client: the silo's own architecture, trained first and "
                                 "distilled into the shared model; never written to the artifact [default: none].")
    model_kwargs: dict = field(default_factory=dict, metadata={"help": "JSON keyword arguments of the local model.",
                                                                "choices": None})
    epochs: int | None = setting(None, "Epochs of the local model [default: the shared model's epochs].",
                                 bounds=(1, ranges.EPOCHS[1]))
    weight: float = setting(0.5, "Weight of the distillation term in the shared model's loss (HBFL's 1 − α).",
                           bounds=(0.0, 1.0))

    def validate(self) -> None:
        check_declared(self)
        if not 0 <= self.weight <= 1:
            raise ConfigError(f"`local_model_weight` must be in [0, 1], got {self.weight}")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"`local_model_epochs` must be >= 1, got {self.epochs}")


@dataclass(frozen=True)
class DPConfig:
    """Differential privacy of the whole client artifact (the mechanisms: :mod:`posterior_fusion.local.privacy`)."""

    dp_epsilon: float = setting(8.0, "The (ε, δ) guarantee of the whole artifact: ε, composed over every component's "
                                  "training, curvature and the class counts.", bounds=(1e-3, 1e3))
    dp_delta: float | None = setting(None, "δ [default: 1/n, n the silo's size].", bounds=(1e-12, 0.1))
    dp_clip: float = setting(1.0, "Per-sample gradient norm bound of DP-SGD.", bounds=(1e-6, 1e6))
    dp_curvature_clip: float = setting(1.0, "Per-sample bound of each sample's contribution to the GGN diagonal, "
                                         "or with structure kron to the output factors and the normalisation "
                                         "layers' diagonals (L2 / Frobenius over all layers): its sensitivity.",
                                       bounds=(1e-9, 1e9))
    dp_input_clip: float = setting(1000.0, "Structure kron: per-sample bound of each sample's contribution to the "
                                           "input factors (Frobenius over all layers): their sensitivity (about the "
                                           "median contribution keeps the factors' scale: LeNet on normalised "
                                           "Fashion-MNIST 1,260).",
                                   bounds=(1e-9, 1e9))
    dp_training_share: float = setting(0.8, "Part of ε that calibrates the training noise; the rest calibrates the "
                                         "curvature and count releases.", bounds=(0.05, 0.95))
    dp_public_transform: bool = setting(False, "The silo's input transform was computed from public data (`import-data "
                                               "--transform from:FILE`), not its own: a private fit refuses a computed "
                                               "transform otherwise (its statistics would be released unaccounted).")

    def validate(self) -> None:
        check_declared(self)


@dataclass(frozen=True)
class PPDConfig:
    """SGLD and distillation settings of ``pfuse fit-local --ppd`` (the chain: :mod:`posterior_fusion.local.ppd`)."""

    steps: int = setting(2000, "SGLD steps of --ppd (burn-in included).", bounds=(1, 10**7))
    burn_in: int = setting(500, "SGLD burn-in steps of --ppd.", bounds=(0, 10**7))
    thin: int = setting(5, "Keep every this many SGLD iterates after the burn-in.", bounds=(1, 10**7))
    step_size: float = setting(1e-5, "SGLD step size ε.", bounds=(1e-15, 1e6))
    batch_size: int = setting(64, "Batch size of the SGLD chain and of the student's distillation.",
                             bounds=ranges.BATCH_SIZE)
    student_lr: float = setting(1e-3, "SGD (momentum 0.9) step of the student per SGLD sample.",
                                bounds=ranges.LEARNING_RATE)
    perturb: float = setting(0.1, "Std of the Gaussian input perturbation of the distillation batch.",
                             bounds=(0.0, 1e6))

    def validate(self) -> None:
        check_declared(self, prefix="ppd_")
        if (self.steps < 1 or not 0 <= self.burn_in < self.steps or self.thin < 1 or not self.step_size > 0
                or self.batch_size < 1 or not self.student_lr > 0 or not self.perturb >= 0):
            raise ConfigError("`ppd` needs steps >= 1, 0 <= burn_in < steps, thin >= 1, step_size > 0, batch_size >= 1, "
                              "student_lr > 0, perturb >= 0")


@dataclass(frozen=True)
class FitConfig:
    """Everything that determines a silo's fit besides the data, the model and the starting points."""

    structure: str = setting("kron", "Curvature structure.", choices=Structure)
    temperature: float = setting(0.1, "Likelihood temperature T recorded for the server.",
                                  bounds=ranges.TEMPERATURE)
    prior_var: float = setting(0.1, "Prior variance σ0² (λ0 = 1/σ0²).", bounds=ranges.PRIOR_VAR)
    train_seed: int = setting(0, "Training seed (data order per component).", bounds=ranges.SEED)
    curvature_batch_size: int = setting(256, "Batch size of the curvature pass.", bounds=ranges.BATCH_SIZE)
    ggn: str = setting("exact", "The generalised Gauss-Newton captured.", choices=GgnType)
    capture: str = setting("fast", "Who computes the curvature.", choices=CaptureMethod)
    kfac: str = setting("expand", "K-FAC for weight-shared (convolution) layers, structure kron. Recorded in the "
                                  "artifact.", choices=KfacType)
    capture_dtype: str = setting("float32", "Arithmetic of the fast capture's forward and backward passes (other "
                                            "than float32 needs the fast capture). Recorded in the artifact.",
                                 choices=CaptureDtype)
    device: str = setting("auto", "Where training, SWAG, FedPPD and the capture run. The artifact is the same "
                                  "whatever the device.", choices=Device)
    compress: float = setting(0.0, "Store each K-FAC factor as its top eigenpairs plus an isotropic remainder, "
                                     "the rank chosen per factor so its relative error (`compress_metric`) stays "
                                     "within this budget (e.g. 0.05; the error is recorded per block); 0: plain "
                                     "factors, exact.", bounds=(0.0, 0.999999))
    compress_metric: str = setting("precision", "The error `compress` bounds (experiments/compression_metric/).",
                                   choices=CompressMetric)
    compress_vectors: str = setting("float32", "Storage type of the compressed factors' kept eigenvectors (the "
                                               "recorded error is that of the stored form).", choices=VectorDtype)
    finetune: str = setting("all", "What a silo fine-tunes of the init file's pretrained base (`init --base`): all "
                                    "(every weight), head (the last module with parameters), last:K (the last K), "
                                    "or lora:R (rank-R adapters on every other Linear/Conv2d, the head trained as "
                                    "it is); the rest stays frozen at the base, bit for bit, and only the trained "
                                    "parameters and their curvature are stored per component.")
    batchnorm: str = setting("fold", "A BatchNorm model trained from random starting points. Fine-tuning a base "
                                     "keeps the base's statistics frozen either way.", choices=BatchnormPolicy)
    dp: DPConfig | None = None  # differential privacy of the whole artifact (local/privacy/)
    ppd: PPDConfig | None = None  # FedPPD: also distil an SGLD chain per component into a student (local/ppd.py)
    local_model: LocalModelConfig | None = None  # HBFL: the silo's own architecture, distilled into the shared one
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> None:
        check_declared(self)
        if not isinstance(self.finetune, str) or not FINETUNE_RE.fullmatch(self.finetune):
            raise ConfigError(f"`finetune` must be all, head, last:K or lora:R (K, R in 1..9999), got "
                              f"{shown(self.finetune, 40)}")
        ranges.check("temperature", self.temperature, ranges.TEMPERATURE)
        ranges.check("prior_var", self.prior_var, ranges.PRIOR_VAR)
        ranges.check("curvature_batch_size", self.curvature_batch_size, ranges.BATCH_SIZE)
        problem = capture_dtype_problem(self.capture_dtype, self.capture, None)  # the model's part: at fit time
        if problem is not None:
            raise ConfigError(problem)
        self.compression.validate()
        if self.ppd is not None:
            self.ppd.validate()
        if self.dp is not None:
            self.dp.validate()
        if self.local_model is not None:
            self.local_model.validate()
        if self.curvature_batch_size < 1:
            raise ConfigError("`curvature_batch_size` must be >= 1")
        self.train.validate()

    @property
    def prior_precision(self) -> float:
        """λ0 = 1/σ0²."""
        return 1.0 / self.prior_var

    @property
    def compression(self) -> Compression:
        """How the artifact's Kronecker factors are written (``compress``, ``compress_metric``,
        ``compress_vectors``)."""
        from posterior_fusion.curvature.compressed import Compression  # the numerics: only when a fit runs

        return Compression(self.compress, self.compress_metric, self.compress_vectors)

    def fingerprint_dict(self) -> dict:
        """The settings that determine the result: ``capture`` (fast or laplace-torch) and ``device``
        (equal at rounding level) are left out, and ``ppd``, ``local_model``, ``kfac``, ``capture_dtype`` and the
        compression at their defaults (a frobenius compress_metric too, the default of earlier versions),
        so caches and partial files written before these options existed keep their keys."""
        out = {k: v for k, v in asdict(self).items() if k not in ("capture", "device")}
        defaults = TrainConfig()
        for key in ("optimizer", "schedule", "warmup_epochs", "grad_clip"):  # keys of earlier caches kept
            if out["train"][key] == getattr(defaults, key):
                out["train"].pop(key)
        if out["kfac"] == "expand" or out["structure"] != "kron":
            out.pop("kfac")
        if out["capture_dtype"] == "float32":
            out.pop("capture_dtype")
        if out["finetune"] == "all":
            out.pop("finetune")
        if out["batchnorm"] == "fold":
            out.pop("batchnorm")
        if out["compress"] == 0:
            out.pop("compress")
        if out["compress_metric"] == "frobenius" or "compress" not in out:
            out.pop("compress_metric")
        if out["compress_vectors"] == "float32" or "compress" not in out:
            out.pop("compress_vectors")
        for optional in ("ppd", "local_model", "dp"):
            if out[optional] is None:
                out.pop(optional)
        return out

    def resolved(self, n_data: int) -> FitConfig:
        """A copy with the automatic weight decay filled in for a silo of ``n_data`` samples."""
        if self.train.weight_decay is not None:
            return self
        wd = auto_weight_decay(self.temperature, self.prior_precision, n_data)
        return replace(self, train=replace(self.train, weight_decay=wd))


# ------------------------------------------------------------------- fit settings, flat

DP_SWITCH_HELP = ("Differential privacy of the whole artifact (every structure): DP-SGD training through Opacus, "
                  "the curvature and the class counts through the Gaussian mechanism, composed by one RDP "
                  "accountant into (dp_epsilon, dp_delta), recorded in the artifact (needs the `dp` extra: opacus).")
PPD_SWITCH_HELP = ("FedPPD: also run an SGLD chain from each component's MAP and distil its posterior predictive "
                   "into a student network stored beside the MAP (fuse --method fedppd / fedppd-distill).")


@dataclass(frozen=True)
class FitSetting:
    """One fit setting under its flat name (``epochs``, ``ppd_steps``, ``local_model``…): where
    it lives in :class:`FitConfig` (``path``), its type, default, help and choices."""

    name: str
    path: tuple[str, ...]
    type: Any
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    bounds: tuple[float, float] | None = None
    choice_docs: dict[str, str] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def run_config_key(self) -> str:
        return self.name.replace("_", "-")


def _declared(cls: type, prefix: str, path: tuple[str, ...]) -> list[FitSetting]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if "help" not in f.metadata:  # nested records (train, ppd, local_model) are listed on their own
            continue
        default = field_default(f)
        out.append(FitSetting(prefix + f.name, (*path, f.name), hints[f.name], default, f.metadata["help"],
                              f.metadata.get("choices"), f.metadata.get("bounds"),
                              f.metadata.get("choice_docs")))
    return out


def fit_settings() -> list[FitSetting]:
    """Every fit setting, declared once on :class:`FitConfig`, :class:`TrainConfig`, :class:`PPDConfig`
    and :class:`LocalModelConfig`: ``fit-local``'s options, the Flower run-config keys and the
    experiment TOML's ``[fit]`` keys are these names (read at call time, so a field added to one of
    the records appears everywhere)."""
    return [*_declared(FitConfig, "", ()), *_declared(TrainConfig, "", ("train",)),
            FitSetting("dp", ("dp",), bool, False, DP_SWITCH_HELP),
            *_declared(DPConfig, "", ("dp",)),  # its fields carry the dp_ prefix themselves
            FitSetting("ppd", ("ppd",), bool, False, PPD_SWITCH_HELP),
            *_declared(PPDConfig, "ppd_", ("ppd",)),
            *[replace(s, name=s.name.replace("local_model_model", "local_model"))
              for s in _declared(LocalModelConfig, "local_model_", ("local_model",))]]


def fit_config_from(values: Mapping[str, Any], where: str = "") -> FitConfig:
    """A validated :class:`FitConfig` from flat settings (names of :func:`fit_settings`; the rest
    take their declared defaults)."""
    table = {s.name: s for s in fit_settings()}
    values = rename_keys(values, {old: new for old, (new, _) in RENAMED_FIT_SETTINGS.items()}, where.rstrip(": ")
                         or "fit settings", lambda msg: print(msg, file=sys.stderr))
    unknown = sorted(set(values) - set(table))
    if unknown:
        raise ConfigError(f"{where}no fit setting {', '.join(map(repr, unknown))}; the fit settings: {', '.join(table)}")
    flat = {name: s.default if values.get(name) is None else convert(values[name], s.type, name, where.rstrip(": "))
            for name, s in table.items()}
    asked = [name for name, s in table.items() if s.path[0] == "dp" and len(s.path) == 2 and flat[name] != s.default]
    if asked and not flat["dp"]:
        raise ConfigError(f"{where}`{asked[0]}` is set but differential privacy is off: set `dp` to fit privately, "
                          "or leave the privacy settings out (an ordinary fit protects nothing)")
    parts: dict[tuple[str, ...], dict[str, Any]] = {}
    for name, s in table.items():
        if len(s.path) == 2:
            parts.setdefault(s.path[:1], {})[s.path[1]] = flat[name]
    own = {s.path[0]: flat[name] for name, s in table.items() if len(s.path) == 1 and s.path[0] not in ("ppd", "dp")}
    cfg = FitConfig(**own, train=TrainConfig(**parts[("train",)]),
                    dp=DPConfig(**parts[("dp",)]) if flat["dp"] else None,
                    ppd=PPDConfig(**parts[("ppd",)]) if flat["ppd"] else None,
                    local_model=LocalModelConfig(**parts[("local_model",)]) if flat["local_model"] else None)
    cfg.validate()
    return cfg
