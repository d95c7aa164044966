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

from posterior_fusion.curvature import CompressedKron, Dense, Diag, Kron, Precision
from posterior_fusion.curvature.compressed import Compression
from posterior_fusion.curvature.truncation import joined

SYMMETRY_RTOL = 1e-4


class BlockValueError(ValueError):
    """A header field or stored tensor of a block is invalid; ``name`` is the offending dataset (or
    header field) so the reader can name the HDF5 path."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message


CURVATURE_MAX = 1e24  # a client block's largest curvature eigenvalue at most: /T ≤ 1e30 for T ≥ 1e-6
GLOBAL_CURVATURE_MAX = 1e30  # a global member's (a sum over up to a million clients' blocks)


def _trace(block: Precision) -> float:
    """The trace of a raw PSD block (an upper bound on its largest eigenvalue), through its dense form:
    the bound of a block kind whose encoding declares none."""
    return float(torch.diagonal(block.to_dense()).double().sum())


def _diag_bound(block: Precision) -> float:
    return float(block.g.double().max()) if block.g.numel() else 0.0


def _dense_bound(block: Precision) -> float:
    return float(torch.diagonal(block.G).double().sum())


def _kron_bound(block: Precision) -> float:
    return float(torch.diagonal(block.B).double().sum()) * float(torch.diagonal(block.A).double().sum())


def _lowrank_bound(block: Precision) -> float:
    out, inn = block.shape
    return ((float(block.lB.double().sum()) + (out - block.lB.numel()) * block.sB)
            * (float(block.lA.double().sum()) + (inn - block.lA.numel()) * block.sA))


def check_curvature_scale(block: Precision, limit: float = CURVATURE_MAX) -> None:
    """A block whose largest curvature eigenvalue may exceed ``limit`` (its encoding's ``eigenvalue_bound``:
    the largest entry of a diagonal, the trace of a dense block, the product of a Kronecker block's factor
    traces, a compressed factor's trace from its kept eigenvalues and σ) raises
    :class:`BlockValueError`: within it the precision ``G/T + λ0 I`` (T ≥ 1e-6) and the sums and products the
    methods form from it stay finite in float32."""
    bound = ENCODINGS[block.kind].eigenvalue_bound(block)
    if not bound <= limit:
        named = {"diag": "diag", "dense": "dense", "kron": "kron_A", "kron_lowrank": "lowrank_A_values"}
        raise BlockValueError(named.get(block.kind, block.kind),
                              f"curvature too large (its largest eigenvalue may reach {bound:.3g}; at most {limit:g})")


def check_psd_factor(name: str, t: torch.Tensor) -> None:
    """Stored factors must be square, symmetric (to ``SYMMETRY_RTOL``) with a non-negative diagonal."""
    if (torch.diagonal(t) < 0).any():
        raise BlockValueError(name, "curvature factor has a negative diagonal entry")
    scale = t.abs().max().item() if t.numel() else 0.0
    if scale > 0 and (t - t.T).abs().max().item() > SYMMETRY_RTOL * scale:
        raise BlockValueError(name, "curvature factor is not symmetric")


PSD_DATASETS = ("dense", "kron_B", "kron_A")  # the datasets check_psd_factor reads


def storable_psd(t: torch.Tensor) -> torch.Tensor:
    """A PSD factor as a writer stores it, so that :func:`check_psd_factor` accepts it whatever the
    rounding of the arithmetic that made it: diagonal entries below 0 set to 0 (a PSD matrix has none;
    a capture's rounding leaves ~1e-16 on near-zero ones); every other entry as it is (a factor
    asymmetric beyond the reader's tolerance is a defect the writer's read-back check reports)."""
    if t.ndim != 2 or t.shape[0] != t.shape[1] or not (torch.diagonal(t) < 0).any():
        return t
    s = t.clone()
    torch.diagonal(s).clamp_(min=0)
    return s


@dataclass(frozen=True)
class BlockEncoding:
    """One block kind on disk: ``dataset_names``; ``header(block)`` (extra JSON fields);
    ``shapes(size, header)`` (dataset name -> shape, raising :class:`BlockValueError`);
    ``decode(tensors, header)`` (the raw block after its value checks; finite is the reader's);
    ``compress(block, compression, prior)``: ``(kind, header, tensors)`` of a compact encoding within
    the :class:`Compression`'s budget (None: the kind is stored as it is whatever the budget);
    ``half_datasets``: the datasets stored as float16 (and only so)."""

    dataset_names: tuple[str, ...]
    shapes: Callable[[int, Mapping[str, Any]], dict[str, tuple[int, ...]]]
    decode: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any]], Precision]
    header: Callable[[Precision], dict[str, Any]] = lambda block: {}
    compress: Callable[[Precision, Compression, float | None],
                       tuple[str, dict[str, Any], dict[str, torch.Tensor]]] | None = None
    half_datasets: tuple[str, ...] = ()
    eigenvalue_bound: Callable[[Precision], float] = _trace


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


LOWRANK_NAMES = ("lowrank_B_vectors", "lowrank_B_values", "lowrank_A_vectors", "lowrank_A_values")
LOWRANK_HALF_NAMES = ("lowrank_B_half_vectors", "lowrank_A_half_vectors")


def _lowrank_header(block: Precision) -> dict[str, Any]:
    header = {"shape": list(block.shape), "rank": [block.lB.numel(), block.lA.numel()],
              "isotropic": [block.sB, block.sA], "error": list(block.errors)}
    if any(block.half_counts):
        header["half"] = list(block.half_counts)
    return header


def _compress_kron(block: Precision, compression: Compression,
                   prior: float | None = None) -> tuple[str, dict[str, Any], dict[str, torch.Tensor]]:
    """A Kronecker block's factors as top-r eigenpairs plus an isotropic remainder
    (:meth:`CompressedKron.from_kron`), each within the budget — relative Frobenius error, or with
    ``prior = λ0·T`` in the precision metric, eigenvectors float16 where ``compression.half``; the header
    records the ranks, the isotropic levels and each factor's error (of the form as stored)."""
    compact = CompressedKron.from_kron(block, compression.budget, prior, compression.half)
    return compact.kind, _lowrank_header(compact), compact.to_tensors()


def _lowrank_shapes(size: int, header: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    sides = _kron_shapes(size, header)
    out, inn = sides["kron_B"][0], sides["kron_A"][0]
    rank, iso, err = header.get("rank"), header.get("isotropic"), header.get("error")
    if (not isinstance(rank, list) or len(rank) != 2 or not all(isinstance(r, int) and not isinstance(r, bool)
                                                              for r in rank)
            or not 0 <= rank[0] <= out or not 0 <= rank[1] <= inn):
        raise BlockValueError("rank", "kron_lowrank block needs rank [r_B, r_A] with 0 <= r <= the factor's side")
    for name, pair in (("isotropic", iso), ("error", err)):
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e38 for v in pair)):
            raise BlockValueError(name, f"kron_lowrank block needs {name} [B, A] of two finite numbers >= 0")
    half = header.get("half", [0, 0])
    if (not isinstance(half, list) or len(half) != 2
            or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= r for h, r in zip(half, rank))):
        raise BlockValueError("half", "kron_lowrank block needs half [h_B, h_A] with 0 <= h <= its rank")
    shapes = dict(zip(LOWRANK_NAMES, ((out, rank[0] - half[0]), (rank[0],), (inn, rank[1] - half[1]), (rank[1],))))
    for name, side, h in zip(LOWRANK_HALF_NAMES, (out, inn), half):
        if h:
            shapes[name] = (side, h)
    return shapes


def _decode_lowrank(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]) -> CompressedKron:
    """The Kronecker block in its compact form (a :class:`Kron` to every fusion method); a factor with
    float16 eigenvectors has them joined to its leading ones and made orthonormal again (float32: the
    form whose error the writer recorded)."""
    parts, stored = [], []
    for side, sigma in zip("BA", header["isotropic"]):
        U, lam = tensors[f"lowrank_{side}_vectors"], tensors[f"lowrank_{side}_values"]
        tail = tensors.get(f"lowrank_{side}_half_vectors")
        whole = U if tail is None else torch.cat([U.double(), tail.double()], 1)
        if (lam < 0).any():
            raise BlockValueError(f"lowrank_{side}_values", "eigenvalues must be >= 0")
        if whole.numel() and (whole.double().T @ whole.double()
                              - torch.eye(whole.shape[1], dtype=torch.float64)).abs().max() > 1e-3:
            raise BlockValueError(f"lowrank_{side}_vectors", "eigenvectors must be orthonormal")
        if lam.numel() and float(lam.min()) < float(sigma) * (1 - 1e-4):
            raise BlockValueError(f"lowrank_{side}_values", "kept eigenvalues must not be below the isotropic level")
        stored.append(None if tail is None else (U, tail))
        if tail is not None:
            U = joined(U, tail).to(U.dtype)
        parts += [U, lam.to(U.dtype), float(sigma)]
    return CompressedKron(*parts, errors=tuple(header["error"]), stored=tuple(stored))


ENCODINGS: dict[str, BlockEncoding] = {
    "diag": BlockEncoding(("diag",), lambda size, header: {"diag": (size,)}, _decode_diag,
                          eigenvalue_bound=_diag_bound),
    "dense": BlockEncoding(("dense",), lambda size, header: {"dense": (size, size)}, _decode_dense,
                           eigenvalue_bound=_dense_bound),
    "kron": BlockEncoding(("kron_B", "kron_A"), _kron_shapes, _decode_kron,
                          header=lambda block: {"shape": list(block.shape)}, compress=_compress_kron,
                          eigenvalue_bound=_kron_bound),
    "kron_lowrank": BlockEncoding(LOWRANK_NAMES + LOWRANK_HALF_NAMES, _lowrank_shapes, _decode_lowrank,
                                  header=_lowrank_header, half_datasets=LOWRANK_HALF_NAMES,
                                  eigenvalue_bound=_lowrank_bound),
}


def dataset_dtypes(kind: str, name: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The dtypes a dataset ``name`` of a ``kind`` block may have: ``allowed`` (the schema's float
    types), or float16 alone where the kind declares the dataset half (eigenvectors, bounded by 1)."""
    return ("float16",) if name in ENCODINGS[kind].half_datasets else allowed
