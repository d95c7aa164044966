"""Reading a silo data file: hostile files and data that does not fit the model, one line each."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

import posterior_fusion
from posterior_fusion.artifact import write_global_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import read_silo
from posterior_fusion.errors import (
    DataError,
    ModelSpecError,
)


def data_file(path, x, y, attrs=None):
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "posterior-fusion-data"
        f.attrs["format_version"] = 1
        f.attrs["num_classes"] = 10
        for k, v in (attrs or {}).items():
            f.attrs[k] = v
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=y)
    return path


DATA_CASES = {
    "array_attr": (lambda p: data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64),
                                       {"num_classes": np.arange(3)}), "scalar"),
    "rank_5": (lambda p: data_file(p, np.zeros((4, 1, 1, 28, 28), np.uint8), np.zeros(4, np.int64)), "rank"),
    "empty": (lambda p: data_file(p, np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.int64)), "empty"),
    "labels_int32": (lambda p: data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int32)), "int64"),
    "extra_object": (lambda p: (data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64)),
                                h5py.File(p, "a").create_dataset("z", data=[1]).file.close())[0], "/z"),
    "soft_link": (lambda p: (data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64)),
                             _soft_x(p))[0], "not allowed"),
    "string_format": (lambda p: data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64),
                                          {"format_version": "1"}), "integer"),
}


def _soft_x(p):
    with h5py.File(p, "a") as f:
        f["y2"] = f["y"][()]
        del f["y"]
        f["y"] = h5py.SoftLink("/y2")


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_hostile_data_files_one_line_each(tmp_path, case):
    make, needle = DATA_CASES[case]
    path = make(tmp_path / f"{case}.h5")
    with pytest.raises(DataError, match=needle) as info:
        read_silo(path)
    assert str(info.value).startswith(str(path))
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(path), "--model", "mlp", "--out", str(tmp_path / "o.h5")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "o.h5").exists()


def test_data_that_does_not_fit_the_model_is_one_line(tmp_path, kron_artifact, small_silo):
    art = posterior_fusion.load(kron_artifact)  # mlp with 784 inputs
    write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"method": "x"}, [art.components[0].map])
    data_file(tmp_path / "wide.h5", np.zeros((5, 40, 40), np.uint8), np.zeros(5, np.int64))
    for cmd in (["evaluate", str(tmp_path / "g.h5"), "--data", str(tmp_path / "wide.h5")],
                ["predict", str(tmp_path / "g.h5"), "--data", str(tmp_path / "wide.h5"), "--out", str(tmp_path / "p.h5")],
                ["fit-local", "--data", str(tmp_path / "wide.h5"), "--model", "lenet", "--out", str(tmp_path / "o.h5")]):
        r = CliRunner().invoke(pfuse, cmd)
        assert r.exit_code == 2 and "do not fit model" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    with pytest.raises(ModelSpecError):
        art.model_spec.check_input((3, 32, 32), "x")
