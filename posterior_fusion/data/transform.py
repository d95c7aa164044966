"""The input transform every silo of a federation shares: ``x ↦ (scale · x − mean) / std``,
per channel for images ``(n, C, H, W)`` (grey images ``(n, H, W)`` get one channel) and per
feature for vectors ``(n, F)``. It is chosen once (computed from a data set, or a data set's
standard constants), stored in every data file, recorded in every artifact, and refused when a
data file's transform disagrees with the artifact's.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from posterior_fusion.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

MAX_CHANNELS = 100_000
SCALE_RANGE = (1e-8, 1e8)   # scale and std of an input transform

# Standard constants of public data sets (mean, std per channel, on inputs scaled to [0, 1]).
CONSTANTS = {
    "fmnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "none": ((0.0,), (1.0,)),
}


@dataclass(frozen=True)
class InputTransform:
    """``(scale · x − mean[c]) / std[c]``; ``mean``/``std`` of length 1 broadcast over channels."""

    scale: float = 1.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    source: str = ""

    def __post_init__(self) -> None:
        lo, hi = SCALE_RANGE
        ok = (lo <= self.scale <= hi and 1 <= len(self.mean) == len(self.std) <= MAX_CHANNELS
              and all(abs(m) <= hi for m in self.mean) and all(lo <= s <= hi for s in self.std))
        if not ok:  # (comparisons are False for NaN, so NaN is refused too)
            raise ConfigError(f"an input transform needs scale and stds in [{lo:g}, {hi:g}], |means| <= {hi:g} and "
                              "as many means as stds: tiny or huge values turn the data into Inf or NaN")

    @classmethod
    def constants(cls, name: str, uint8: bool = True) -> InputTransform:
        if name not in CONSTANTS:
            raise ConfigError(f"no standard constants for {name!r}; known: {', '.join(CONSTANTS)}")
        mean, std = CONSTANTS[name]
        return cls(1 / 255 if uint8 else 1.0, mean, std, f"constants {name}")

    @classmethod
    def compute(cls, x: np.ndarray, source: str, chunk: int = 4096) -> InputTransform:
        """Per-channel (images) or per-feature (vectors) mean and std of ``x`` after scaling, in
        float64, accumulated over chunks of samples (memory: one chunk, not a float64 copy of ``x``)."""
        width = x.shape[1] if x.ndim in (2, 4) else 1  # features, or channels ((n, H, W) images: one)
        if x.ndim < 2 or 0 in x.shape[1:]:
            raise DataError(f"{source}: the inputs have no features (shape {x.shape})")
        if width > MAX_CHANNELS:
            raise DataError(f"{source}: {width:,} features, more than the {MAX_CHANNELS:,} a computed input transform "
                            "holds (one mean and std per feature); choose `transform` none")
        scale = 1 / 255 if x.dtype == np.uint8 else 1.0
        axes = (0,) if x.ndim == 2 else (0, 1, 2) if x.ndim == 3 else (0, 2, 3)
        per = x.shape[0] * (1 if x.ndim == 2 else math.prod(x.shape[1:3]) if x.ndim == 3 else math.prod(x.shape[2:]))
        total = sum(x[i : i + chunk].astype(np.float64).sum(axis=axes) for i in range(0, x.shape[0], chunk))
        mean = np.atleast_1d(total * scale / per)
        shape = (1, -1) + (1,) * (x.ndim - 2) if x.ndim == 4 else (1, -1) if x.ndim == 2 else (1, 1, 1)
        sq = sum(((x[i : i + chunk].astype(np.float64) * scale - mean.reshape(shape)) ** 2).sum(axis=axes)
                 for i in range(0, x.shape[0], chunk))
        std = np.atleast_1d(np.sqrt(sq / per))
        std = np.where(std > 1e-8, std, 1.0)
        return cls(scale, tuple(float(m) for m in mean), tuple(float(s) for s in std), f"computed from {source}")

    def key(self) -> tuple:
        """What must agree between files (the ``source`` note does not)."""
        return (round(self.scale, 12), tuple(round(m, 9) for m in self.mean), tuple(round(s, 9) for s in self.std))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, where: str = "") -> InputTransform:
        try:
            obj = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
            if not isinstance(obj, dict) or set(obj) - {"scale", "mean", "std", "source"}:
                raise ValueError("unexpected fields")
            return cls(float(obj["scale"]), tuple(float(v) for v in obj["mean"]), tuple(float(v) for v in obj["std"]),
                       str(obj.get("source", ""))[:200])
        except (ValueError, TypeError, KeyError, ConfigError) as exc:
            raise DataError(f"{where}: invalid input transform ({exc})") from None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj, where: str = "") -> InputTransform:
        return cls.from_json(json.dumps(obj), where)

    def apply(self, x: np.ndarray, where: str = "data") -> torch.Tensor:
        """float32 tensor: ``(n, C, H, W)`` for images (a channel axis is added to ``(n, H, W)``), ``(n, F)`` for vectors."""
        import torch  # here, not at import: describing data files needs no torch

        t = torch.from_numpy(np.asarray(x, dtype=np.float32)) * self.scale
        if t.ndim == 3:
            t = t.unsqueeze(1)
        channels = t.shape[1]
        if len(self.mean) not in (1, channels):
            raise DataError(f"{where}: its input transform has {len(self.mean)} channels, the data {channels}")
        shape = (1, -1) + (1,) * (t.ndim - 2)
        mean = torch.tensor(self.mean, dtype=torch.float32).reshape(shape)
        std = torch.tensor(self.std, dtype=torch.float32).reshape(shape)
        return (t - mean) / std


def check_transform(expected: dict | None, actual: InputTransform, data_file: str, artifact: str) -> None:
    """Refuse data whose input transform differs from the one an artifact was trained with
    (``expected`` is the artifact's recorded ``input_transform``; ``None``: nothing recorded)."""
    if expected is None:
        return
    want = InputTransform.from_dict(expected, artifact)
    if want.key() != actual.key():
        raise DataError(f"{data_file}: its input transform (scale {actual.scale:g}, mean {list(actual.mean)[:4]}, "
                        f"std {list(actual.std)[:4]}) differs from the one {artifact} was trained with "
                        f"(scale {want.scale:g}, mean {list(want.mean)[:4]}, std {list(want.std)[:4]}); "
                        "import the data again with the federation's transform: `transform` from:FILE, FILE a "
                        "data file that has it (e.g. a client's silo)")
