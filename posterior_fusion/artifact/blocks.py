"""How each curvature block kind is stored in an artifact: its dataset names, the header fields
beyond ``kind``/``offset``/``size``, the dataset shapes a header implies (checked before any data
is read) and the value checks of what is read back. :data:`ENCODINGS` is the table per block kind
(the maths of a block is :mod:`posterior_fusion.curvature`'s; a new kind adds its encoding here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from posterior_fusion.curvature import Dense, Diag, Kron, Precision

SYMMETRY_RTOL = 1e-4


class BlockValueError(ValueError):
    """A header field or stored tensor of a block is invalid; ``name`` is the offending dataset (or
    header field) so the reader can name the HDF5 path."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message


def check_psd_factor(name: str, t: torch.Tensor) -> None:
    """Stored factors must be square, symmetric (to ``SYMMETRY_RTOL``) with a non-negative diagonal."""
    if (torch.diagonal(t) < 0).any():
        raise BlockValueError(name, "curvature factor has a negative diagonal entry")
    scale = t.abs().max().item() if t.numel() else 0.0
    if scale > 0 and (t - t.T).abs().max().item() > SYMMETRY_RTOL * scale:
        raise BlockValueError(name, "curvature factor is not symmetric")


@dataclass(frozen=True)
class BlockEncoding:
    """One block kind on disk: ``dataset_names``; ``header(block)`` (extra JSON fields);
    ``shapes(size, header)`` (dataset name -> shape, raising :class:`BlockValueError`);
    ``decode(tensors, header)`` (the raw block after its value checks; finite is the reader's)."""

    dataset_names: tuple[str, ...]
    shapes: Callable[[int, Mapping[str, Any]], dict[str, tuple[int, ...]]]
    decode: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any]], Precision]
    header: Callable[[Precision], dict[str, Any]] = lambda block: {}


def _decode_diag(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> Diag:
    if (tensors["diag"] < 0).any():
        raise BlockValueError("diag", "diagonal curvature has negative entries")
    return Diag(tensors["diag"])


def _decode_dense(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> Dense:
    check_psd_factor("dense", tensors["dense"])
    return Dense(tensors["dense"])


def _kron_shapes(size: int, header: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    shape = header.get("shape")
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
            or shape[0] * shape[1] != size):
        raise BlockValueError("shape", "kron block needs shape [out, in] with out*in == size")
    return {"kron_B": (shape[0], shape[0]), "kron_A": (shape[1], shape[1])}


def _decode_kron(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> Kron:
    for name in ("kron_B", "kron_A"):
        check_psd_factor(name, tensors[name])
    return Kron(tensors["kron_B"], tensors["kron_A"])


ENCODINGS: dict[str, BlockEncoding] = {
    "diag": BlockEncoding(("diag",), lambda size, header: {"diag": (size,)}, _decode_diag),
    "dense": BlockEncoding(("dense",), lambda size, header: {"dense": (size, size)}, _decode_dense),
    "kron": BlockEncoding(("kron_B", "kron_A"), _kron_shapes, _decode_kron,
                          header=lambda block: {"shape": list(block.shape)}),
}
