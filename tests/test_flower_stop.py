"""The documented local Flower example, stopped: ``flwr stop`` ends the silos' work, and the stop step of
``docs/flower.md`` (the SuperLink, the SuperExec, then Ray) leaves no process of the run behind, counted by
pid. Each command of the stop step is applied only to this run's processes (found by a marker in their
environment), so runs of other tests on the machine are left alone. About 45 s on 2 cores."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed")  # scripts/setup.sh installs it

from posterior_fusion.data.silo import SiloData, write_silo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def processes(marker: str) -> dict[int, str]:
    """pid → command line of every live process whose environment holds ``marker`` (zombies left out)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if marker.encode() not in (proc / "environ").read_bytes():
                continue
            out[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
    return out


def stop_step() -> list[str]:
    """The stop step's commands as docs/flower.md writes them (the line after the local run)."""
    text = (ROOT / "docs" / "flower.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("pkill -f flower-superlink"))
    return [c.strip() for c in line.split("#")[0].split(";") if c.strip()]


def apply(command: str, marker: str) -> None:
    """One command of the stop step, on this run's processes only: ``pkill -f PATTERN`` signals those whose
    command line matches; ``ray stop`` those of Ray (its workers, raylet, GCS, dashboard and monitors)."""
    if command.startswith("pkill -f "):
        pattern = re.compile(command.split(None, 2)[2])
    elif command.startswith("ray stop"):
        pattern = re.compile(r"ray::|/ray/|raylet|gcs_server")
    else:
        raise AssertionError(f"docs/flower.md's stop step has a command this test does not know: {command!r}")
    for pid, cmd in processes(marker).items():
        if pattern.search(cmd):
            try:
                os.kill(pid, signal.SIGKILL if command.startswith("ray stop") and "--force" in command else
                        signal.SIGTERM)
            except ProcessLookupError:
                pass


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(1)
    return predicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc (Linux)")
def test_a_stopped_local_run_ends_the_silos_work_and_the_stop_step_leaves_no_process(tmp_path, fmnist_train):
    x, y = fmnist_train
    silos = tmp_path / "silos"
    silos.mkdir()
    for c in range(3):
        write_silo(silos / f"client_{c}.h5", SiloData(x[c * 200:(c + 1) * 200], y[c * 200:(c + 1) * 200],
                                                      "fmnist", 10))
    write_silo(silos / "server_val.h5", SiloData(x[-100:], y[-100:], "fmnist", 10))
    app = tmp_path / "app"
    shutil.copytree(ROOT / "examples" / "flower", app)
    marker = f"PFUSE_STOP_TEST={uuid.uuid4().hex}"
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "RAY_TMPDIR": ray_dir,
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "PFUSE_PROGRESS": "0", marker.split("=")[0]: marker.split("=")[1]}
    try:
        started = subprocess.run(
            [str(BIN / "flwr"), "run", ".", "--federation-config", "num-supernodes=3", "--run-config",
             f'epochs=5000 components=1 min-nodes=3 model="lenet" structure="diag" silo-dir="{silos}" '
             f'out-dir="{tmp_path / "out"}" val="{silos / "server_val.h5"}"'],
            env=env, cwd=app, capture_output=True, text=True, timeout=120)
        found = re.search(r"started run (\d+)", started.stdout + started.stderr)
        assert found, started.stdout + started.stderr
        training = lambda: any("ClientAppActor" in c for c in processes(marker).values())  # noqa: E731
        assert wait_until(training, 120), f"no silo started training:\n{processes(marker)}"
        stopped = subprocess.run([str(BIN / "flwr"), "stop", found.group(1)], env=env, cwd=app, capture_output=True,
                                 text=True, timeout=60)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        # flwr stop ends the silos' work: 5,000 LeNet epochs would take far longer than the wait
        assert wait_until(lambda: not training(), 90), f"the silos kept training:\n{processes(marker)}"
        assert not (tmp_path / "out" / "global.h5").exists()
        for command in stop_step():
            apply(command, marker)
            time.sleep(2)
        left = processes(marker)
        assert wait_until(lambda: not processes(marker), 30), f"left behind by the stop step: {left}"
    finally:
        for pid in processes(marker):  # whatever happened above: nothing of this run outlives the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_dir, ignore_errors=True)
