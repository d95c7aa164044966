"""Init files: the starting points a silo trains from."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from posterior_fusion.artifact import write_global_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec


def test_an_init_file_with_more_starting_points_than_the_cap_is_refused_before_training(tmp_path, small_silo):
    """``fit-local --init`` of a file holding 257 starting points: one line naming the file, exit 2, before
    any training (no progress line), nothing written."""
    silo = SiloData(small_silo.x[:40, ::4, ::4].copy(), small_silo.y[:40], "fmnist", 10)
    write_silo(tmp_path / "s.h5", silo)
    spec = ModelSpec("mlp", {"in_features": 49, "hidden": 2})
    layout = ParameterLayout.from_model(spec.build())
    write_global_artifact(tmp_path / "init.h5", spec, layout, {"method": "init"}, [torch.zeros(layout.dim)] * 257)
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--init", str(tmp_path / "init.h5"),
                                   "--epochs", "1", "--out", str(tmp_path / "c.h5")])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "init.h5: holds 257 starting points" in lines[0], r.output
    assert not (tmp_path / "c.h5").exists()
