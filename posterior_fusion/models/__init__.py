"""Model registry: models are rebuilt from a JSON spec ``{"name": ..., "kwargs": {...}}``.

Nothing is ever unpickled: a spec names a registered builder and keyword arguments, which
are checked against the builder's declared arguments and types.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from posterior_fusion.errors import ModelSpecError


def lenet(num_classes: int = 10, in_channels: int = 1, bias: bool = False) -> nn.Sequential:
    """FedBEns LeNet for 28x28 inputs: conv(1->6,5) pool conv(6->16,5) pool fc 256->120->84->C.

    Without biases (the paper's default) it has 44,190 parameters.
    """
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(256, 120, bias=bias), nn.ReLU(),
        nn.Linear(120, 84, bias=bias), nn.ReLU(),
        nn.Linear(84, num_classes, bias=bias),
    )


def cnn(num_classes: int = 10, in_channels: int = 3, bias: bool = False) -> nn.Sequential:
    """The paper's SVHN/CIFAR10 CNN for 32x32 inputs: conv(3->32,5) conv(32->64,5) fc 1600->512->128->C."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1600, 512, bias=bias), nn.ReLU(),
        nn.Linear(512, 128, bias=bias), nn.ReLU(),
        nn.Linear(128, num_classes, bias=bias),
    )


def mlp(num_classes: int = 10, in_features: int = 784, hidden: int = 32, bias: bool = True) -> nn.Sequential:
    """A small two-layer perceptron on flattened inputs (used by fast tests)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_features, hidden, bias=bias), nn.ReLU(),
        nn.Linear(hidden, num_classes, bias=bias),
    )


# name -> (builder, {kwarg: type}); the types are what a JSON spec may carry.
MODEL_REGISTRY: dict[str, tuple[Callable[..., nn.Module], dict[str, type]]] = {
    "lenet": (lenet, {"num_classes": int, "in_channels": int, "bias": bool}),
    "cnn": (cnn, {"num_classes": int, "in_channels": int, "bias": bool}),
    "mlp": (mlp, {"num_classes": int, "in_features": int, "hidden": int, "bias": bool}),
}

MAX_SPEC_INT = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    """A model named in :data:`MODEL_REGISTRY` with validated keyword arguments."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in MODEL_REGISTRY:
            raise ModelSpecError(f"unknown model {self.name!r}; known: {', '.join(sorted(MODEL_REGISTRY))}")
        allowed = MODEL_REGISTRY[self.name][1]
        if not isinstance(self.kwargs, dict):
            raise ModelSpecError("model kwargs must be a JSON object")
        for key, value in self.kwargs.items():
            if key not in allowed:
                raise ModelSpecError(f"model {self.name!r} takes no argument {key!r}; allowed: {', '.join(allowed)}")
            expected = allowed[key]
            ok = isinstance(value, bool) if expected is bool else (
                isinstance(value, expected) and not isinstance(value, bool))
            if not ok:
                raise ModelSpecError(f"model argument {key!r} must be {expected.__name__}, got {value!r}")
            if expected is int and not (1 <= value <= MAX_SPEC_INT):
                raise ModelSpecError(f"model argument {key!r}={value} is out of range [1, {MAX_SPEC_INT}]")

    def build(self) -> nn.Module:
        return MODEL_REGISTRY[self.name][0](**self.kwargs)

    def check_input(self, sample_shape: tuple[int, ...], where: str) -> None:
        """Refuse data whose per-sample shape (after the loader's channel axis) does not fit
        this model; runs the model on PyTorch's meta device (no allocation, no compute)."""
        import torch

        with torch.device("meta"):
            model = self.build()
            try:
                out = model(torch.empty(2, *sample_shape))
            except (RuntimeError, ValueError, IndexError) as exc:
                raise ModelSpecError(f"{where}: inputs of shape {tuple(sample_shape)} do not fit model "
                                     f"{self.name!r} {self.kwargs} ({str(exc).splitlines()[0][:120]})") from None
        if tuple(out.shape) != (2, self.num_classes):
            raise ModelSpecError(f"{where}: model {self.name!r} gives outputs {tuple(out.shape[1:])} on inputs "
                                 f"of shape {tuple(sample_shape)}, expected ({self.num_classes},)")

    @property
    def num_classes(self) -> int:
        return int(self.kwargs.get("num_classes", 10))

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "kwargs": self.kwargs}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ModelSpecError(f"model spec is not valid JSON: {exc}") from None
        if not isinstance(obj, dict) or set(obj) != {"name", "kwargs"} or not isinstance(obj["name"], str):
            raise ModelSpecError('model spec must be {"name": str, "kwargs": {...}}')
        return cls(obj["name"], obj["kwargs"])
