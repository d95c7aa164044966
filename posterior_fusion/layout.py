"""Parameter layout: names, shapes and offsets of the flat parameter vector.

The flat vector is ``torch.nn.utils.parameters_to_vector(model.parameters())``: parameters
in registration order, each flattened row-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParameterEntry:
    """One named parameter: ``shape`` and its ``offset`` in the flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def matrix_shape(self) -> tuple[int, int] | None:
        """``(out, in*k*k)`` for weights of rank >= 2, ``None`` for vectors (biases)."""
        if len(self.shape) < 2:
            return None
        return self.shape[0], math.prod(self.shape[1:])


@dataclass(frozen=True)
class ParameterLayout:
    """Ordered parameters of a model; ``dim`` is the flat vector length d."""

    entries: tuple[ParameterEntry, ...]

    @classmethod
    def from_shapes(cls, named_shapes: list[tuple[str, tuple[int, ...]]]) -> ParameterLayout:
        entries, offset = [], 0
        for name, shape in named_shapes:
            entry = ParameterEntry(str(name), tuple(int(s) for s in shape), offset)
            entries.append(entry)
            offset += entry.size
        return cls(tuple(entries))

    @classmethod
    def from_model(cls, model: nn.Module) -> ParameterLayout:
        return cls.from_shapes([(n, tuple(p.shape)) for n, p in model.named_parameters()])

    @property
    def dim(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def to_json(self) -> list[dict]:
        return [{"name": e.name, "shape": list(e.shape)} for e in self.entries]

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Flat ``(..., d)`` -> list of ``(..., *shape)`` views, one per parameter."""
        lead = flat.shape[:-1]
        return [flat[..., e.offset : e.offset + e.size].reshape(*lead, *e.shape) for e in self.entries]
