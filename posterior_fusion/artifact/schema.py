"""Artifact schema: names, version, caps and the whitelist of HDF5 paths.

See ``docs/artifact-format.md`` for the full description.
"""

from __future__ import annotations

import re

FORMAT_NAME = "posterior-fusion"
FORMAT_VERSION = 1
KIND_CLIENT = "client"
KIND_GLOBAL = "global"

STRUCTURES = ("diag", "diag+full", "kron")
BLOCK_KINDS = ("diag", "dense", "kron")

# Caps: checked against declared shapes before anything is allocated.
MAX_PARAMS = 50_000_000
MAX_COMPONENTS = 256
MAX_MEMBERS = 1024
MAX_DENSE_SIDE = 8192
MAX_SWAG_RANK = 256
MAX_JSON_CHARS = 4_000_000
MAX_LAYOUT_ENTRIES = 10_000
MAX_BLOCKS = 10_000

ROOT_ATTRS = {"format", "format_version", "artifact_kind", "model_spec", "layout", "metadata"}

_IDX = r"(0|[1-9][0-9]{0,5})"
CLIENT_PATHS = [
    r"/components",
    rf"/components/{_IDX}",
    rf"/components/{_IDX}/map",
    rf"/components/{_IDX}/curvature",
    rf"/components/{_IDX}/curvature/{_IDX}",
    rf"/components/{_IDX}/curvature/{_IDX}/(diag|dense|kron_B|kron_A)",
    rf"/components/{_IDX}/swag",
    rf"/components/{_IDX}/swag/(mean|sq_mean|deviations)",
]
GLOBAL_PATHS = [
    r"/members",
    rf"/members/{_IDX}",
    rf"/members/{_IDX}/weights",
]
CLIENT_PATH_RE = re.compile("^(" + "|".join(CLIENT_PATHS) + ")$")
GLOBAL_PATH_RE = re.compile("^(" + "|".join(GLOBAL_PATHS) + ")$")

FLOAT_DTYPES = ("float32", "float64")
