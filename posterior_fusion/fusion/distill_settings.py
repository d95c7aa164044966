"""The distillation recipes' settings (``fuse --distill``), declared once and free of torch (the CLI's options
are generated from them): :class:`TeachingConfig` for the ``consistent`` and ``data-free`` recipes
(:mod:`posterior_fusion.fusion.teaching`); FedBE's recipe keeps its own schedule
(:class:`posterior_fusion.fusion.distill.DistillConfig`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from posterior_fusion import ranges
from posterior_fusion.choices import Choice
from posterior_fusion.errors import ConfigError
from posterior_fusion.settings import check_declared, setting


class Recipe(Choice):
    """A distillation recipe."""

    CONSISTENT = "consistent", ("the teacher on the student's own augmented view at every step, KL at a temperature, "
                                "Adam with a cosine schedule, a moving average (docs/methods.md, \"Distillation\"); "
                                "without unlabeled server data it synthesises its inputs (data-free)")
    SWA = "swa", ("FedBE's schedule (SWA, cyclic step size 1e-3 -> 4e-4, sharpened pseudo-labels, distill_epochs), "
                  "on unlabeled server data")


class Flip(Choice):
    """The horizontal flip of image inputs."""

    AUTO = "auto", "where the teacher's top class agrees on flipped held-out inputs for 95 % of them"
    ON = "on", "always"
    OFF = "off", "never"


class MomentLayers(Choice):
    """Which recorded input second moments the data-free inputs match."""

    FIRST = "first", "the first layer's, pooled over the clients"
    ALL = "all", ("the first layer's, and every later layer's under the clients' own networks against their "
                  "recorded K-FAC input factors")


class StudentStart(Choice):
    """Where the student starts."""

    MEMBER = "member", "the member agreeing most with the teacher"
    SCRATCH = "scratch", "a fresh initialisation at `seed`"


RECIPES = Recipe.values()


@dataclass(frozen=True)
class RecipeChoice:
    """Which distillation recipe ``fuse --distill`` runs, and FedBE's schedule length."""

    recipe: str = setting("consistent", "How the student is taught.", choices=Recipe)
    epochs: int | None = setting(None, "Epochs of the swa recipe and of method fedbe (its setting distill_epochs) "
                                       "[default: 20, FedBE's].", bounds=ranges.EPOCHS)


@dataclass(frozen=True)
class TeachingConfig:
    """The consistent and data-free recipes' settings (module doc)."""

    steps: int = setting(3000, "Student optimisation steps.", bounds=(1, 10**7))
    batch_size: int = setting(128, "Student batch size.", bounds=(2, 65536))
    lr: float = setting(2e-3, "Adam's peak learning rate (cosine decay to 0).", bounds=(1e-8, 10.0))
    temperature: float = setting(2.0, "Temperature of the KL divergence from the teacher to the student.",
                                 bounds=(0.05, 100.0))
    pad: int = setting(2, "Images: the random shift's padding in pixels (0: none).", bounds=(0, 64))
    flip: str = setting("auto", "Images: the horizontal flip.", choices=Flip)
    mixup: float = setting(1.0, "Mixup's Beta(a, a) parameter (0: no mixup).", bounds=(0.0, 100.0))
    cutmix: float = setting(0.0, "Images: CutMix's Beta(a, a) parameter, a box of another input of the batch pasted "
                                 "in, of area 1 - lambda (0: none); with mixup as well, each batch takes one of the "
                                 "two at random.", bounds=(0.0, 100.0))
    start: str = setting("member", "The student's start.", choices=StudentStart)
    ema: float = setting(0.999, "Decay of the moving average of the student's weights that is kept (0: the last "
                                "iterate).", bounds=(0.0, 0.999999))
    seed: int = setting(0, "Seed of the student's start, batches and augmentations.", bounds=(0, 2**63 - 1))
    views: int = setting(0, "Augmented views of each input taught once and cached, the steps drawing their batches "
                            "from them (0: a fresh view at every step). The teacher is still evaluated on the "
                            "student's exact view: views x inputs teacher evaluations in all, instead of steps x "
                            "batch_size.", bounds=(0, 10**4))
    student: str = setting("", "The student's model, another than the clients' (smaller or wider): a model name, or "
                               "its spec as JSON, e.g. {\"name\": \"lenet\", \"kwargs\": {\"width\": 2}}; it "
                               "starts from scratch [default: the clients' architecture].")
    synth_size: int = setting(5000, "Data-free: how many inputs to synthesise.", bounds=(10, 10**7))
    synth_steps: int = setting(200, "Data-free: optimisation steps per synthetic batch.", bounds=(1, 10**6))
    moment_weight: float = setting(10.0, "Data-free: weight of the first-layer second-moment mismatch.",
                                   bounds=(0.0, 1e6))
    moment_layers: str = setting("first", "Data-free: the recorded input second moments matched.",
                                 choices=MomentLayers)
    input_shape: str = setting("", "Data-free: one input's shape, e.g. 1,28,28 [default: the clients' recorded "
                                   "input_shape].")

    def validate(self) -> None:
        check_declared(self, "distillation")
        self.shape()
        if len(self.student) > 2000:
            raise ConfigError("distillation setting 'student' must be a model name or spec of at most 2,000 "
                              "characters")

    def shape(self) -> tuple[int, ...] | None:
        """``input_shape`` as a tuple (None where it is not set)."""
        if not self.input_shape:
            return None
        try:
            shape = tuple(int(v) for v in self.input_shape.split(","))
        except ValueError:
            shape = ()
        if not 1 <= len(shape) <= 4 or not all(1 <= v <= 4096 for v in shape) or math.prod(shape) > 2**24:
            raise ConfigError(f"distillation setting 'input_shape' must be 1 to 4 sizes like 1,28,28, got "
                              f"{self.input_shape[:40]!r}")
        return shape

    def to_json(self) -> dict:
        return asdict(self)
