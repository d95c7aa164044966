"""Input transforms: refused where they make infinities or NaNs."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from conftest import cli, one_error_line


@pytest.mark.parametrize("transform", [{"scale": 1e-300, "mean": [0.0], "std": [1.0]},
                                       {"scale": 1.0, "mean": [0.0], "std": [1e-30]},
                                       {"scale": 1e300, "mean": [0.0], "std": [1.0]},
                                       {"scale": 1.0, "mean": [1e200], "std": [1.0]}])
def test_transforms_that_make_inf_or_nan_are_refused(tmp_path, silo_file, transform):
    with h5py.File(silo_file, "r+") as f:
        f.attrs["transform"] = np.bytes_(json.dumps(transform).encode())
    line = one_error_line(cli("fit-local", "--data", silo_file, "--model", "mlp", "--out", tmp_path / "o.h5"))
    assert "transform" in line and not (tmp_path / "o.h5").exists()
