"""Errors: one line, the file named, strings from files escaped and short, every refusal a PfuseError."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from conftest import cli, one_error_line

import posterior_fusion
from posterior_fusion.artifact.writer import text_attr
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import PfuseError, shown, terminal_safe


def test_strings_from_files_are_printed_escaped_and_short(tmp_path, kron_artifact):
    evil = "\x1b[2J\x1b[32mALL CLIENTS OK\x1b[0m\nsecond line"
    for field, value in (("provider", evil), ("provider", "p" * 3_000_000), ("name", evil)):
        bad = tmp_path / f"{field}{len(value)}.h5"
        bad.write_bytes(kron_artifact.read_bytes())
        with h5py.File(bad, "r+") as f:
            spec = json.loads(bytes(f.attrs["model_spec"]).decode())
            spec[field] = value
            f.attrs["model_spec"] = text_attr(json.dumps(spec))
        r = cli("fuse", bad, bad, "--method", "fedavg", "--out", tmp_path / "g.h5")
        line = one_error_line(r)
        assert "\x1b" not in r.stderr and len(line) < 2_200
    meta_bad = tmp_path / "meta.h5"
    meta_bad.write_bytes(kron_artifact.read_bytes())
    with h5py.File(meta_bad, "r+") as f:
        f["components/0"].attrs["training"] = text_attr(json.dumps({"note": evil}))
    r = cli("inspect", meta_bad)
    assert "\x1b" not in r.output and "\x1b" not in (r.stderr or "")


def test_shown_and_terminal_safe():
    assert shown("a\nb\x1b[2J") == repr("a\nb\x1b[2J") and "\n" not in shown("a\nb")
    assert len(shown("x" * 10_000)) == 200
    assert terminal_safe("ok\n\x1b[31mred\x07") == "ok\n\\x1b[31mred\\x07"


def test_refusals_name_the_file(tmp_path, small_silo, two_clients):
    rgb = tmp_path / "rgb.h5"
    with h5py.File(rgb, "w") as f:  # a transform of 3 channels on grey data
        f.attrs.update({"format": "posterior-fusion-data", "format_version": 1, "dataset": "d", "num_classes": 10})
        f.attrs["transform"] = np.bytes_(json.dumps({"scale": 1, "mean": [0, 0, 0], "std": [1, 1, 1]}).encode())
        f["x"] = small_silo.x[:5]
        f["y"] = small_silo.y[:5]
    assert str(rgb) in one_error_line(cli("fit-local", "--data", rgb, "--model", "mlp", "--out", tmp_path / "o.h5"))
    g = tmp_path / "g.h5"
    assert cli("fuse", *two_clients, "--method", "fedavg", "--out", g).exit_code == 0
    other = tmp_path / "other.h5"
    write_silo(other, SiloData(small_silo.x[:50], small_silo.y[:50], "fmnist", 10,
                               transform=posterior_fusion.data.transform.InputTransform(1 / 255, (0.5,), (0.5,), "x")))
    test = tmp_path / "test.h5"
    write_silo(test, SiloData(small_silo.x[:50], small_silo.y[:50], "fmnist", 10))
    for opt in ("--ood", "--scale-from"):
        extra = ["--predictive", "mc"] if opt == "--scale-from" else []
        r = cli("evaluate", g, "--data", test, opt, other, *extra)
        if opt == "--scale-from" and "needs a global posterior" in (r.stderr or ""):
            continue  # fedavg has no posterior: the scale is never chosen
        assert str(other) in one_error_line(r) and "transform" in r.stderr


def test_every_refusal_is_a_pfuse_error(tmp_path):
    with pytest.raises(PfuseError):
        posterior_fusion.load(tmp_path / "missing.h5")
