"""``posterior_fusion.artifact.preview``: what ``pfuse inspect`` reads without torch — the header's facts as the
validating reader sees them, and the file's structure refused as the reader refuses it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

import posterior_fusion
from posterior_fusion.artifact.preview import preview
from posterior_fusion.cli.main import pfuse
from posterior_fusion.errors import SchemaError
from posterior_fusion.summary import summarize

CLI = ("import sys, json; from posterior_fusion.cli.main import main; sys.argv = ['pfuse', *sys.argv[1:]]\n"
           "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
           "print(json.dumps({'torch': 'torch' in sys.modules, 'code': code}), file=sys.stderr)")


def inspect_in_a_child(*args) -> tuple[dict, str]:
    """``pfuse inspect ARGS`` in a fresh interpreter: (``{torch imported?, exit code}``, its stdout)."""
    proc = subprocess.run([sys.executable, "-c", CLI, "inspect", *map(str, args)], capture_output=True, text=True,
                          timeout=120)
    return json.loads(proc.stderr.strip().splitlines()[-1]), proc.stdout


@pytest.fixture(scope="module")
def global_artifact(tmp_path_factory, kron_artifact):
    out = tmp_path_factory.mktemp("global") / "g.h5"
    other = out.with_name("other.h5")
    shutil.copy(kron_artifact, other)
    with h5py.File(other, "r+") as f:  # another client: its MAP moved a little, so the two files differ
        f["/components/0/map"][...] = f["/components/0/map"][...] + np.float32(1e-3)
    r = CliRunner().invoke(pfuse, ["-q", "fuse", str(kron_artifact), str(other), "--method", "fedavg", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_the_preview_agrees_with_the_validated_summary(kron_artifact):
    s = preview(kron_artifact)
    full = summarize(posterior_fusion.load(kron_artifact))
    assert s["num_params"] == full["num_params"] and s["sha256"] == full["sha256"]
    assert [c["curvature_bytes"] for c in s["components"]] == [c["curvature_bytes"] for c in full["components"]]
    assert [c["curvature_bytes_per_param"] for c in s["components"]] == \
        [c["curvature_bytes_per_param"] for c in full["components"]]
    assert [e["shape"] for e in s["layout"]] == [list(e["shape"]) for e in full["layout"]]


@pytest.mark.parametrize("json_flag", [False, True])
def test_inspect_imports_no_torch_for_a_client_or_a_global_artifact(kron_artifact, global_artifact, json_flag):
    for path in (kron_artifact, global_artifact):
        state, out = inspect_in_a_child(path, *(["--json"] if json_flag else []))
        assert state == {"torch": False, "code": 0}, out
        if json_flag:
            assert json.loads(out)["validated"] == "header"
        else:
            assert "checked: the header" in out
    state, out = inspect_in_a_child(kron_artifact, "--validate")  # the control: the full read does import torch
    assert state == {"torch": True, "code": 0} and "values included" in out


def _hostile(src, dst, edit):
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        edit(f)
    return dst


STRUCTURE = {
    "soft_link": lambda f: f.__setitem__("/components/0/alias", h5py.SoftLink("/components/0/map")),
    "off_schema_path": lambda f: f.create_dataset("/components/0/notes", data=np.zeros(3, np.float32)),
    "extra_root_attribute": lambda f: f.attrs.__setitem__("owner", np.bytes_(b"x")),
    "unknown_kind": lambda f: f.attrs.__setitem__("artifact_kind", np.bytes_(b"server")),
}


@pytest.mark.parametrize("case", sorted(STRUCTURE))
def test_a_file_of_the_wrong_structure_is_refused_by_the_header_read_alone(kron_artifact, tmp_path, case):
    bad = _hostile(kron_artifact, tmp_path / f"{case}.h5", STRUCTURE[case])
    with pytest.raises(SchemaError):
        preview(bad)
    for extra in ([], ["--validate"]):  # the reader refuses it too: the header read is not looser on structure
        r = CliRunner().invoke(pfuse, ["inspect", str(bad), *extra])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and str(bad) in r.stderr, r.stderr


def test_values_are_checked_only_by_validate(kron_artifact, tmp_path):
    """A NaN in a MAP is a value: the header read says the header is fine and that values were not read; the
    full read refuses it in one line."""
    def nan_map(f):
        f["/components/0/map"][0] = np.nan

    bad = _hostile(kron_artifact, tmp_path / "nan.h5", nan_map)
    ok = CliRunner().invoke(pfuse, ["inspect", str(bad)])
    assert ok.exit_code == 0 and "--validate checks every value" in ok.stdout
    r = CliRunner().invoke(pfuse, ["inspect", str(bad), "--validate"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "/components/0/map" in r.stderr, r.stderr


def test_evaluate_and_predict_refuse_a_forged_header_before_importing_torch(kron_artifact, global_artifact, tmp_path):
    """The header checks of ``evaluate`` and ``predict`` are the torch-free header read: a file of the wrong
    structure, or a client artifact where a global one is due, is one line and exit 2 with torch never imported."""
    bad = _hostile(global_artifact, tmp_path / "bad.h5", STRUCTURE["soft_link"])
    for args in (["evaluate", bad, "--data", tmp_path / "unread.h5"], ["predict", bad, "--data", tmp_path / "x.h5",
                                                                       "--out", tmp_path / "p.h5"],
                 ["evaluate", kron_artifact, "--data", tmp_path / "unread.h5"]):
        proc = subprocess.run([sys.executable, "-c", CLI, *map(str, args)],
                              capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert json.loads(lines[-1]) == {"torch": False, "code": 2}, proc.stderr
        assert len(lines) == 2 and str(args[1]) in lines[0], proc.stderr
