"""``recapture``: another structure at the trained MAPs equals a fresh fit with that structure."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import fit_artifact

from posterior_fusion.artifact import load_client
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.local.recapture import recapture


def _same_components(a, b, tol: float = 1e-6) -> None:
    assert len(a) == len(b)
    for ca, cb in zip(a, b):
        assert torch.equal(ca.map, cb.map)
        da, db = ca.curvature.to_dense().double(), cb.curvature.to_dense().double()
        assert da.shape == db.shape
        assert (da - db).norm() <= tol * db.norm()


@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_recaptured_kron_fit_equals_a_fresh_fit(tmp_path, small_silo, kron_artifact, structure):
    fresh_meta, fresh = fit_artifact(tmp_path / "fresh.h5", small_silo, structure, swag=True)
    source = load_client(kron_artifact)
    meta, comps = recapture(source, small_silo, structure, log=lambda *_: None)
    _same_components(comps, fresh)
    # the kron source's curvature is not what came back
    assert comps[0].curvature.to_dense().shape == fresh[0].curvature.to_dense().shape
    assert not torch.allclose(source.components[0].curvature.to_dense(), comps[0].curvature.to_dense())
    assert meta["structure"] == structure and meta["recaptured_from"]["structure"] == "kron"
    assert meta["recaptured_from"]["fit_fingerprint"] == source.metadata["fit_fingerprint"] != meta["fit_fingerprint"]
    for c, s in zip(comps, source.components):  # SWAG moments and training records travel with the MAPs
        assert torch.equal(c.swag.deviations, s.swag.deviations)
        assert c.training["seed"] == s.training["seed"]


def test_mc_recapture_draws_the_fresh_fits_labels(tmp_path, small_silo, kron_artifact):
    _, fresh = fit_artifact(tmp_path / "fresh.h5", small_silo, "diag", swag=True, ggn="mc")
    _, comps = recapture(load_client(kron_artifact), small_silo, "diag", ggn="mc", log=lambda *_: None)
    _same_components(comps, fresh)


def test_cli_recapture_and_a_foreign_silo(tmp_path, small_silo, kron_artifact):
    write_silo(tmp_path / "silo.h5", small_silo)
    out = tmp_path / "diag.h5"
    result = CliRunner().invoke(pfuse, ["recapture", "--from", str(kron_artifact), "--data", str(tmp_path / "silo.h5"),
                                        "--structure", "diag", "--out", str(out)])
    assert result.exit_code == 0, result.output
    art = load_client(out)
    assert art.structure == "diag" and art.num_components == 2
    assert torch.equal(art.components[1].map, load_client(kron_artifact).components[1].map)

    other = SiloData(small_silo.x[:200], small_silo.y[:200], "fmnist", 10)
    write_silo(tmp_path / "other.h5", other)
    bad = CliRunner().invoke(pfuse, ["recapture", "--from", str(kron_artifact), "--data", str(tmp_path / "other.h5"),
                                     "--structure", "diag", "--out", str(tmp_path / "x.h5")])
    assert bad.exit_code == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "other.h5" in lines[0] and "not the silo" in lines[0]
    assert not (tmp_path / "x.h5").exists()
    same = CliRunner().invoke(pfuse, ["recapture", "--from", str(out), "--data", str(tmp_path / "silo.h5"),
                                      "--structure", "kron", "--out", str(out)])
    assert same.exit_code == 2 and "must differ" in same.stderr
