"""The method registry (fusion/registry.py): every method runs, refusals are one line."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.errors import IncompatibleArtifactsError, MethodNotApplicableError
from posterior_fusion.fusion import fuse


@pytest.mark.parametrize("method", ["fedbens", "fedfisher", "fedavg", "fisher-merge", "regmean", "fedlpa", "fedbe", "swag",
                                    "ensemble"])
def test_every_method_runs_and_members_are_independent(tmp_path, fitted, method):
    folder, paths = fitted
    out = tmp_path / "g.h5"
    result = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", method, "--out", str(out),
                                        "--val", str(folder / "val.h5"), "--steps", "20", "--val-every", "5"])  # deprecated spellings: warn, apply where they exist
    assert result.exit_code == 0, result.stderr
    g = posterior_fusion.load(out)
    assert g.method == method and len(g.metadata["provenance"]) == 3
    assert {p["sha256"] for p in g.metadata["provenance"]} == {posterior_fusion.load(p).sha256 for p in paths}
    models = g.models()
    if len(models) > 1:
        before = [torch.nn.utils.parameters_to_vector(m.parameters()).clone() for m in models]
        with torch.no_grad():
            next(models[0].parameters()).add_(1.0)
        for m, b in zip(models[1:], before[1:]):
            assert torch.equal(torch.nn.utils.parameters_to_vector(m.parameters()), b)
    ev = CliRunner().invoke(pfuse, ["evaluate", str(out), "--data", str(folder / "val.h5"), "--json"])
    assert ev.exit_code == 0, ev.stderr


def test_refusals(tmp_path, fitted):
    folder, paths = fitted
    with pytest.raises(IncompatibleArtifactsError, match="no client"):
        fuse([], "fedavg")
    with pytest.raises(IncompatibleArtifactsError, match="lenet.h5"):
        fuse([paths[0], folder / "lenet.h5"], "fedavg")
    with pytest.raises(IncompatibleArtifactsError, match="same number of mixtures"):
        fuse([paths[0], folder / "m3.h5"], "fedbens")
    with pytest.raises(IncompatibleArtifactsError, match="given twice"):
        fuse([paths[0], paths[0]], "fedavg")
    with pytest.raises(MethodNotApplicableError, match="product"):
        fuse(paths, "product")
    with pytest.raises(MethodNotApplicableError, match="regmean"):
        fuse([folder / "diag_0.h5"], "regmean")
    with pytest.raises(MethodNotApplicableError, match="fedlpa"):
        fuse([folder / "diag_0.h5"], "fedlpa")
    with pytest.raises(MethodNotApplicableError, match="SWAG"):
        fuse([folder / "diag_0.h5"], "swag")
    r = CliRunner().invoke(pfuse, ["fuse", str(paths[0]), str(folder / "lenet.h5"), "--out", str(tmp_path / "x.h5")])
    assert r.exit_code != 0 and r.stderr.count("\n") == 1 and "lenet.h5" in r.stderr
    r = CliRunner().invoke(pfuse, ["fuse", "--method", "fedavg", "--out", str(tmp_path / "x.h5")])
    assert r.exit_code != 0 and "no client artifacts" in r.stderr
    assert not (tmp_path / "x.h5").exists()
