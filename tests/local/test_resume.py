"""Crash-safe fit-local: kill the process mid-run, resume, get the same artifact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
from click.testing import CliRunner

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo

ARGS = ["--model", "lenet", "-M", "3", "--epochs", "2", "--structure", "kron", "--train-seed", "7", "--init-seed", "1"]


def run_cli(*args):
    return CliRunner().invoke(pfuse, list(args))


def test_kill_then_resume_equals_uninterrupted(tmp_path, fmnist_train):
    x, y = fmnist_train
    write_silo(tmp_path / "silo.h5", SiloData(x[:800], y[:800], "fmnist", 10))
    silo = str(tmp_path / "silo.h5")
    ref = run_cli("fit-local", "--data", silo, *ARGS, "--out", str(tmp_path / "ref.h5"))
    assert ref.exit_code == 0, ref.stderr

    out = tmp_path / "killed.h5"
    partial = tmp_path / ".killed.h5.partial.h5"
    cmd = [sys.executable, "-c", "from posterior_fusion.cli.main import main; main()",
           "fit-local", "--data", silo, *ARGS, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not partial.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert partial.exists(), "the partial artifact should exist after the first component"
    assert not out.exists(), "killed before the end: no final artifact may appear"
    done = posterior_fusion.load(partial).num_components
    assert 1 <= done < 3

    res = run_cli("fit-local", "--data", silo, *ARGS, "--out", str(out), "--resume")
    assert res.exit_code == 0, res.stderr
    assert f"resuming: {done} of 3" in res.stderr
    assert not partial.exists()
    a, b = posterior_fusion.load(tmp_path / "ref.h5"), posterior_fusion.load(out)
    assert a.metadata["fit_fingerprint"] == b.metadata["fit_fingerprint"]
    for ca, cb in zip(a.components, b.components, strict=True):
        torch.testing.assert_close(cb.map, ca.map, rtol=0, atol=0)
        for ba, bb in zip(ca.curvature.blocks, cb.curvature.blocks):
            torch.testing.assert_close(bb.B, ba.B, rtol=0, atol=0)
            torch.testing.assert_close(bb.A, ba.A, rtol=0, atol=0)


def test_resume_with_other_settings_is_refused(tmp_path, fmnist_train):
    x, y = fmnist_train
    write_silo(tmp_path / "silo.h5", SiloData(x[:200], y[:200], "fmnist", 10))
    silo = str(tmp_path / "silo.h5")
    args = ["--model", "mlp", "-M", "2", "--epochs", "1", "--structure", "diag"]
    assert run_cli("fit-local", "--data", silo, *args, "--out", str(tmp_path / "a.h5")).exit_code == 0
    # Fake an interrupted run: the first component of a run with a different seed.
    full = posterior_fusion.load(tmp_path / "a.h5")
    from posterior_fusion.artifact import write_client_artifact

    write_client_artifact(tmp_path / ".b.h5.partial.h5", full.model_spec, full.layout, dict(full.metadata),
                          list(full.components[:1]))
    res = run_cli("fit-local", "--data", silo, *args, "--train-seed", "5", "--out", str(tmp_path / "b.h5"), "--resume")
    assert res.exit_code != 0 and "different settings" in res.stderr
    assert not (tmp_path / "b.h5").exists()
