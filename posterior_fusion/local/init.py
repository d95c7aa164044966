"""Shared starting points: the same per-mode initialisation on every client."""

from __future__ import annotations

import hashlib

import torch
from torch.nn.utils import parameters_to_vector

from posterior_fusion.models import ModelSpec


def init_fingerprint(spec: ModelSpec, inits: list[torch.Tensor]) -> str:
    """sha256 of the model spec and the starting points: equal on every client that trains
    component m from the same point for every m (what FedBEns' per-mode fusion needs)."""
    h = hashlib.sha256(spec.to_json().encode())
    for w in inits:
        h.update(w.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def initial_weights(spec: ModelSpec, num_modes: int, init_seed: int) -> list[torch.Tensor]:
    """``num_modes`` flat ``(d,)`` vectors from PyTorch's default initialisers.

    Mode ``m`` is drawn with seed ``init_seed * 1_000_003 + m``, so every client that uses
    the same ``init_seed`` gets the same starting point per mode.
    """
    out = []
    for m in range(num_modes):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed * 1_000_003 + m)
            out.append(parameters_to_vector(spec.build().parameters()).detach().clone())
    return out
