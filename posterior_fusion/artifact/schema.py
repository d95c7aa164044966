"""Artifact schema: names, version, caps and the whitelist of HDF5 paths.

See ``docs/artifact-format.md`` for the full description.
"""

from __future__ import annotations

import re

from posterior_fusion import ranges

FORMAT_NAME = "posterior-fusion"
FORMAT_VERSION = 2           # 2: global artifacts may carry each member's Laplace curvature
READABLE_VERSIONS = (1, 2)
KIND_CLIENT = "client"
KIND_GLOBAL = "global"

COMPRESSION_UNRECORDED = {"compress_metric": "frobenius", "compress_vectors": "float32"}  # an absent key's meaning

STRUCTURE_RE = re.compile(r"^[a-z0-9][a-z0-9+_-]{0,31}$")  # a label; the blocks themselves are checked

# Caps: checked against declared shapes before anything is allocated.
MAX_PARAMS = 50_000_000
MAX_COMPONENTS = 256
MAX_MEMBERS = 1024
MAX_DENSE_SIDE = 8192
MAX_SWAG_RANK = 256
MAX_JSON_CHARS = 4_000_000
MAX_TEXT_BYTES = 128_000_000   # all text attributes of one file together
MAX_LAYOUT_ENTRIES = 10_000
MAX_BLOCKS = 10_000
MAX_JSON_DEPTH = 32
MAX_JSON_INT_DIGITS = 20
MAX_N_DATA = ranges.N_DATA[1]
TEMPERATURE_RANGE = ranges.TEMPERATURE
PRIOR_PRECISION_RANGE = ranges.PRIOR_PRECISION

ROOT_ATTRS = {"format", "format_version", "artifact_kind", "model_spec", "layout", "metadata"}

_IDX = r"(0|[1-9][0-9]{0,5})"

FLOAT_DTYPES = ("float32", "float64")


def _dataset_names() -> str:
    from posterior_fusion.artifact.blocks import ENCODINGS  # here, not at import: the header preview is torch-free

    return "|".join(sorted({re.escape(n) for enc in ENCODINGS.values() for n in enc.dataset_names}))


ANY_DATASET_NAME = r"[A-Za-z_][A-Za-z0-9_]{0,39}"  # the header preview's curvature dataset names (torch-free)


def global_path_re(names: str | None = None) -> re.Pattern:
    """The whitelist of global-artifact paths (members, and optionally their Laplace curvature); ``names``:
    a pattern for the curvature dataset names (default: exactly the block-type table's)."""
    return re.compile("^(" + "|".join([
        r"/frozen",
        r"/members",
        rf"/members/{_IDX}",
        rf"/members/{_IDX}/weights",
        rf"/members/{_IDX}/curvature",
        rf"/members/{_IDX}/curvature/{_IDX}",
        rf"/members/{_IDX}/curvature/{_IDX}/({names or _dataset_names()})",
    ]) + ")$")


def client_path_re(names: str | None = None) -> re.Pattern:
    """The whitelist of client-artifact paths; curvature dataset names come from the block-type table (or
    match ``names``)."""
    names = names or _dataset_names()
    return re.compile("^(" + "|".join([
        r"/prior_mean",
        r"/frozen",
        r"/components",
        rf"/components/{_IDX}",
        rf"/components/{_IDX}/map",
        rf"/components/{_IDX}/curvature",
        rf"/components/{_IDX}/curvature/{_IDX}",
        rf"/components/{_IDX}/curvature/{_IDX}/({names})",
        rf"/components/{_IDX}/swag",
        rf"/components/{_IDX}/swag/(mean|sq_mean|deviations)",
        rf"/components/{_IDX}/ppd_student",
        rf"/components/{_IDX}/statistics",
    ]) + ")$")
