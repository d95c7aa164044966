"""The published JSON Schema of the artifact header (docs/artifact-header.schema.json) describes what
the writer writes and what the reader accepts (checked with a small validator for the keywords it uses)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import pytest

import posterior_fusion
from posterior_fusion.artifact import write_global_artifact

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "docs" / "artifact-header.schema.json").read_text())


def check(value, schema, path="$"):
    """Validate ``value`` against a JSON Schema using: type, const, enum, required, properties,
    additionalProperties (false), items, min/maxItems, minimum, maximum, maxLength, pattern."""
    t = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float)}
    if t and (not isinstance(value, types[t]) or isinstance(value, bool)):
        raise AssertionError(f"{path}: expected {t}, got {type(value).__name__}")
    if "const" in schema and value != schema["const"]:
        raise AssertionError(f"{path}: expected {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise AssertionError(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise AssertionError(f"{path}: missing {key!r}")
        props = schema.get("properties", {})
        for key, v in value.items():
            if key in props:
                check(v, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                raise AssertionError(f"{path}: unexpected {key!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", 10**9):
            raise AssertionError(f"{path}: {len(value)} items out of range")
        for i, v in enumerate(value):
            if "items" in schema:
                check(v, schema["items"], f"{path}[{i}]")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", -float("inf")) or value > schema.get("maximum", float("inf")):
            raise AssertionError(f"{path}: {value} out of range")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", 10**9) or ("pattern" in schema and not re.match(schema["pattern"], value)):
            raise AssertionError(f"{path}: {value!r} does not match")


def header(path):
    with h5py.File(path) as f:
        out = {k: (json.loads(bytes(v).decode()) if k in ("model_spec", "layout", "metadata")
                   else int(v) if k == "format_version" else bytes(v).decode()) for k, v in f.attrs.items()}
        comps = [(json.loads(bytes(f[f"/components/{i}"].attrs["training"]).decode()),
                  json.loads(bytes(f[f"/components/{i}/curvature"].attrs["blocks"]).decode()))
                 for i in range(out["metadata"].get("num_components", 0))]
    return out, comps


def test_written_artifacts_match_the_published_schema(tmp_path, kron_artifact):
    head, comps = header(kron_artifact)
    check(head, SCHEMA)
    check(head["metadata"], SCHEMA["properties"]["client_metadata"])
    for training, blocks in comps:
        check(training, SCHEMA["properties"]["training"])
        check(blocks, SCHEMA["properties"]["blocks"])
    art = posterior_fusion.load(kron_artifact)
    write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"method": "x"}, [art.components[0].map])
    g, _ = header(tmp_path / "g.h5")
    check(g, SCHEMA)
    check(g["metadata"], SCHEMA["properties"]["global_metadata"])


@pytest.mark.parametrize("change", [{"n_data": 0}, {"temperature": 1e7}, {"structure": "Kron!"}, {"num_components": 300}])
def test_schema_and_reader_refuse_the_same_metadata(kron_artifact, change):
    head, _ = header(kron_artifact)
    meta = dict(head["metadata"], **change)
    with pytest.raises(AssertionError):
        check(meta, SCHEMA["properties"]["client_metadata"])
    from posterior_fusion.artifact.records import ClientMetadata, HeaderProblem

    with pytest.raises(HeaderProblem):
        ClientMetadata.parse(meta, 10)
