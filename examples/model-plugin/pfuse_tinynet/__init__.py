"""A model plugin for posterior-fusion: a builder whose annotated keyword arguments (int,
float, bool, str, list[int]) are what an artifact's model spec may set."""

from __future__ import annotations

from torch import nn


def tinynet(num_classes: int = 10, in_features: int = 784, width: int = 64) -> nn.Module:
    """Flatten -> Linear(in_features, width) -> tanh -> Linear(width, num_classes)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, num_classes))
