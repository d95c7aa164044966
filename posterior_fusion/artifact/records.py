"""Typed header records of an artifact, each parsed from untrusted JSON with one ``parse``.

The reader turns the JSON attributes of a file into these frozen records before it reads any
data; every check of a header value lives here. A failed check raises
:class:`HeaderProblem` (the HDF5 path and what is wrong); the reader adds the file name and
raises :class:`~posterior_fusion.errors.SchemaError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from posterior_fusion.artifact import schema
from posterior_fusion.artifact.blocks import ENCODINGS, BlockValueError
from posterior_fusion.artifact.jsonattr import HeaderProblem, _is_int, _is_number, parse_json  # noqa: F401 (re-exported)
from posterior_fusion.errors import ConfigError
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.pooling import Pooling


def number_in(where: str, name: str, value: Any, lo: float, hi: float, integer: bool = False) -> float | int:
    """``value`` must be a finite number (an integer if ``integer``) in ``[lo, hi]``."""
    ok = _is_int(value) if integer else _is_number(value)
    if not ok or not lo <= value <= hi:
        kind = "an integer" if integer else "a finite number"
        raise HeaderProblem(where, f"metadata field {name!r} must be {kind} in [{lo:g}, {hi:g}], got {str(value)[:40]}")
    return value


def parse_layout(raw: Any) -> ParameterLayout:
    if not isinstance(raw, list) or not 1 <= len(raw) <= schema.MAX_LAYOUT_ENTRIES:
        raise HeaderProblem("/", "layout must be a non-empty JSON list")
    named: list[tuple[str, tuple[int, ...]]] = []
    total = 0
    for i, e in enumerate(raw):
        ok = (isinstance(e, dict) and set(e) == {"name", "shape"} and isinstance(e["name"], str)
              and len(e["name"]) <= 256 and isinstance(e["shape"], list) and 1 <= len(e["shape"]) <= 5
              and all(_is_int(s) and 1 <= s <= schema.MAX_PARAMS for s in e["shape"]))
        if not ok:
            raise HeaderProblem("/", f"layout entry {i} must be {{'name': str, 'shape': [positive ints]}}")
        total += math.prod(e["shape"])
        if total > schema.MAX_PARAMS:
            raise HeaderProblem("/", f"layout declares more than {schema.MAX_PARAMS} parameters")
        named.append((e["name"], tuple(e["shape"])))
    return ParameterLayout.from_shapes(named)


@dataclass(frozen=True)
class BlockRecord:
    """One curvature block of a component: its ``kind`` (a key of the block-type table), the
    slice ``[offset, offset + size)`` of the parameters, extra header fields, and the datasets
    (name -> shape) the kind's class declares for it."""

    kind: str
    offset: int
    size: int
    fields: Mapping[str, Any]
    datasets: Mapping[str, tuple[int, ...]]

    @classmethod
    def parse(cls, raw: Any, where: str, expected_offset: int, layout: ParameterLayout) -> BlockRecord:
        if not isinstance(raw, dict) or raw.get("kind") not in ENCODINGS:
            raise HeaderProblem(where, f"block kind must be one of {tuple(ENCODINGS)}")
        size, off = raw.get("size"), raw.get("offset")
        if not (_is_int(size) and _is_int(off)) or size < 1:
            raise HeaderProblem(where, "block offset/size must be integers, size >= 1")
        if off != expected_offset:
            raise HeaderProblem(where, f"blocks do not tile the parameters: offset {off}, expected {expected_offset}")
        fields = {k: v for k, v in raw.items() if k not in ("kind", "offset", "size")}
        try:
            datasets = ENCODINGS[raw["kind"]].shapes(size, fields)
        except BlockValueError as exc:
            raise HeaderProblem(where, exc.message) from None
        for name, shape in datasets.items():
            if any(s > schema.MAX_DENSE_SIDE for s in shape[1:]) or (len(shape) > 1 and shape[0] > schema.MAX_DENSE_SIDE):
                raise HeaderProblem(f"{where}/{name}", f"{raw['kind']} block dataset of shape {shape} exceeds the cap {schema.MAX_DENSE_SIDE}")
        if off + size > layout.dim:
            raise HeaderProblem(where, f"block [{off}, {off + size}) runs past the {layout.dim} parameters")
        if "shape" in fields:  # a matrix-shaped block must be exactly one weight of the layout
            entry = {e.offset: e for e in layout.entries}.get(off)
            if entry is None or list(entry.matrix_shape or ()) != fields["shape"]:
                raise HeaderProblem(where, f"{raw['kind']} block {fields['shape']} at offset {off} is not a weight of the layout")
        return cls(raw["kind"], off, size, fields, datasets)


TRAINING_FIELDS: dict[str, tuple[type, ...]] = {
    "seed": (int,), "epochs": (int,), "final_loss": (int, float), "final_accuracy": (int, float),
    "train_seconds": (int, float), "curvature_seconds": (int, float),
    "ppd_samples": (int,), "ppd_seconds": (int, float), "ppd_chain_excess_noise": (int, float),
    "refreshed_at_member": (int,), "gradient_norm": (int, float), "newton_step_norm": (int, float),
    "damping": (int, float), "step_ratio": (int, float), "curvature_from": (int,),
}
TRAINING_CHOICES: dict[str, tuple[str, ...]] = {"capture": ("fast", "laplace"), "device": ("cpu", "cuda"),
                                                 "gain_test": ("passed", "failed", "not run")}  # string fields: allowed values


def parse_training(raw: Any, where: str) -> dict[str, Any]:
    """A component's training record: only known fields, each of its type and finite."""
    if not isinstance(raw, dict):
        raise HeaderProblem(where, "attribute 'training' must be a JSON object")
    for key, value in raw.items():
        if key in TRAINING_CHOICES:
            if value not in TRAINING_CHOICES[key]:
                raise HeaderProblem(where, f"training field {key!r} must be one of {TRAINING_CHOICES[key]}")
            continue
        types = TRAINING_FIELDS.get(key)
        if types is None:
            raise HeaderProblem(where, f"training field {str(key)[:40]!r} is not part of the schema")
        if isinstance(value, bool) or not isinstance(value, types) or not _is_number(value):
            raise HeaderProblem(where, f"training field {key!r} must be a finite {types[-1].__name__}")
    return dict(raw)


@dataclass(frozen=True)
class ComponentRecord:
    """Header of ``/components/<index>``: training record, curvature blocks, SWAG rank (or None),
    and whether it carries a FedPPD student (``ppd_student``) and folded BatchNorm ``statistics``."""

    index: int
    training: Mapping[str, Any]
    blocks: tuple[BlockRecord, ...]
    swag_rank: int | None
    has_student: bool = False
    has_statistics: bool = False  # BatchNorm statistics folded into the MAP, (2 S,)

    @staticmethod
    def parse_blocks(raw: Any, where: str, layout: ParameterLayout) -> tuple[BlockRecord, ...]:
        if not isinstance(raw, list) or not 1 <= len(raw) <= schema.MAX_BLOCKS:
            raise HeaderProblem(where, "attribute 'blocks' must be a non-empty JSON list")
        blocks: list[BlockRecord] = []
        offset = 0
        for i, b in enumerate(raw):
            blocks.append(BlockRecord.parse(b, f"{where}/{i}", offset, layout))
            offset += blocks[-1].size
        if offset != layout.dim:
            raise HeaderProblem(where, f"blocks cover {offset} of {layout.dim} parameters")
        return tuple(blocks)

    def dataset_paths(self) -> dict[str, tuple[int, ...]]:
        """Every curvature dataset path of this component -> its declared shape."""
        base = f"/components/{self.index}/curvature"
        return {f"{base}/{j}/{name}": shape for j, b in enumerate(self.blocks) for name, shape in b.datasets.items()}


def check_global_metadata(meta: dict[str, Any], num_members: int, has_curvature: bool, num_classes: int,
                          num_blocks: int = 0) -> None:
    """The typed fields of a global artifact's metadata: ``mode_weights`` (``num_members``
    probabilities summing to 1), ``pooling`` (:meth:`Pooling.from_metadata`) and, with curvature,
    ``laplace.prior_precision`` in range (one number, or one per curvature block: ``num_blocks``)."""
    check_class_names(meta, num_classes)
    if "pooling" in meta:
        try:
            pooling = Pooling.from_metadata(meta["pooling"], num_members, num_classes)
        except ConfigError as exc:
            raise HeaderProblem("/", str(exc)) from None
        if pooling.rule != "average" and has_curvature:
            raise HeaderProblem("/", f"metadata field 'pooling': {pooling.rule} pools client members; "
                                     "it does not apply to members with a Laplace posterior")
    weights = meta.get("mode_weights")
    if weights is not None:
        if (not isinstance(weights, list) or len(weights) != num_members or not all(_is_number(w) for w in weights)
                or min(weights) < 0 or abs(sum(weights) - 1) > 1e-6):
            raise HeaderProblem("/", f"metadata field 'mode_weights' must be {num_members} numbers >= 0 summing to 1")
    if has_curvature:
        laplace = meta.get("laplace")
        if not isinstance(laplace, dict) or "prior_precision" not in laplace:
            raise HeaderProblem("/", "metadata field 'laplace' with its 'prior_precision' is needed beside curvature")
        delta = laplace["prior_precision"]
        if isinstance(delta, list):
            if len(delta) != num_blocks:
                raise HeaderProblem("/", f"metadata field 'laplace.prior_precision' must be one number or one per "
                                         f"curvature block ({num_blocks}), got a list of {len(delta)}")
            for v in delta:
                number_in("/", "laplace.prior_precision", v, *schema.PRIOR_PRECISION_RANGE)
        else:
            number_in("/", "laplace.prior_precision", delta, *schema.PRIOR_PRECISION_RANGE)


@dataclass(frozen=True)
class ClientMetadata:
    """The typed part of a client artifact's ``metadata`` (the rest is kept as provenance)."""

    n_data: int
    class_counts: tuple[int, ...]
    temperature: float
    prior_precision: float
    structure: str
    num_components: int

    @classmethod
    def parse(cls, meta: dict[str, Any], num_classes: int) -> ClientMetadata:
        for key in ("n_data", "class_counts", "temperature", "prior_precision", "structure", "num_components"):
            if key not in meta:
                raise HeaderProblem("/", f"metadata field {key!r} missing")
        n = number_in("/", "n_data", meta["n_data"], 1, schema.MAX_N_DATA, integer=True)
        t = number_in("/", "temperature", meta["temperature"], *schema.TEMPERATURE_RANGE)
        lam = number_in("/", "prior_precision", meta["prior_precision"], *schema.PRIOR_PRECISION_RANGE)
        m = number_in("/", "num_components", meta["num_components"], 1, schema.MAX_COMPONENTS, integer=True)
        if not isinstance(meta["structure"], str) or not schema.STRUCTURE_RE.match(meta["structure"]):
            raise HeaderProblem("/", f"structure {str(meta['structure'])[:40]!r} is not a structure name")
        counts = meta["class_counts"]
        if (not isinstance(counts, list) or len(counts) != num_classes
                or not all(_is_int(c) and 0 <= c <= n for c in counts) or sum(counts) != n):
            raise HeaderProblem("/", f"metadata field 'class_counts' must be {num_classes} non-negative integers summing to n_data={n}")
        check_class_names(meta, num_classes)
        return cls(int(n), tuple(counts), float(t), float(lam), str(meta["structure"]), int(m))


def check_class_names(meta: dict[str, Any], num_classes: int) -> None:
    """The optional metadata field ``class_names``: one text of at most 200 characters per class."""
    names = meta.get("class_names")
    if names is not None and (not isinstance(names, list) or len(names) != num_classes
                              or not all(isinstance(v, str) and len(v) <= 200 for v in names)):
        raise HeaderProblem("/", f"metadata field 'class_names' must list {num_classes} texts of at most 200 characters")
