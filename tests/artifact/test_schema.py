"""The published JSON Schema of the artifact header (docs/artifact-header.schema.json) describes what
the writer writes and what the reader accepts (checked with a small validator for the keywords it uses)."""

from __future__ import annotations

import json

import h5py
import pytest
from conftest import SCHEMA, check

import posterior_fusion
from posterior_fusion.artifact import write_global_artifact


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
