"""``posterior_fusion/flower/transfer.py`` through a real deployment: a SuperLink whose HTTP APIs accept requests
of at most 8 MiB (as a reverse proxy in front of it would), two SuperNodes on localhost, artifacts of about 19 MiB each up, a global artifact of
about 10 MiB down in the refresh round and the refreshed artifacts up again — every file arrives bit for bit
(a file sent as one record field would be refused by the transport). About a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed")  # scripts/setup.sh installs it

from conftest import free_port, stop_process_groups  # noqa: E402

from posterior_fusion.data.silo import SiloData, write_silo  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower"
BIN = Path(sys.executable).parent
LIMIT = 8 << 20  # the largest request the SuperLink accepts in this test
HIDDEN = 3000  # an MLP of 2.39 M weights: MAP and diagonal curvature about 19 MiB per artifact

LAUNCHER = """import sys
import flwr.superlink.main
from flwr.superlink.cli import flower_superlink

LIMIT = int(sys.argv.pop(1))
create_app = flwr.superlink.main.create_app


def limited(app):  # a reverse proxy's request-body limit in front of the SuperLink's HTTP APIs
    async def asgi(scope, receive, send):
        size = dict(scope.get("headers") or []).get(b"content-length")
        if scope["type"] == "http" and (size is None or int(size) > LIMIT) and scope["method"] == "POST":
            await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await app(scope, receive, send)
    return asgi


flwr.superlink.main.create_app = lambda *a, **k: limited(create_app(*a, **k))
sys.argv[0] = "flower-superlink"
flower_superlink()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses process groups (Linux)")
def test_artifacts_larger_than_the_message_limit_arrive_bit_for_bit(tmp_path, fmnist_train):
    x, y = fmnist_train
    silos, out, app = tmp_path / "silos", tmp_path / "out", tmp_path / "app"
    silos.mkdir()
    for c in range(2):
        write_silo(silos / f"silo_{c}.h5", SiloData(x[c * 200 : (c + 1) * 200], y[c * 200 : (c + 1) * 200],
                                                   "fmnist", 10))
    write_silo(silos / "val.h5", SiloData(x[-100:], y[-100:], "fmnist", 10))
    import shutil

    shutil.copytree(EXAMPLE, app)
    (tmp_path / "launch_superlink.py").write_text(LAUNCHER)
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    (tmp_path / "run.toml").write_text(
        f'model = "mlp"\nmodel-kwargs = \'{{"hidden": {HIDDEN}}}\'\ncomponents = 1\nstructure = "diag"\n'
        f'epochs = 1\nmin-nodes = 2\nout-dir = "{out}"\nval = "{silos / "val.h5"}"\nmethod = "fedavg"\n'
        'refresh = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PFUSE_PROGRESS": "0"}
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def start(name: str, cmd: list[str]) -> None:
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "wb") as f:
            procs[name] = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=app,
                                           start_new_session=True)

    def tails() -> str:
        return "\n".join(f"--- {n}\n" + p.read_text(errors="replace")[-2000:] for n, p in logs.items())

    try:
        start("superlink", [sys.executable, str(tmp_path / "launch_superlink.py"), str(LIMIT), "--insecure",
                            "--port", str(port), "--disable-runtime-dependency-installation"])
        deadline = time.time() + 60
        while "Uvicorn running on http" not in logs["superlink"].read_text(errors="replace"):
            assert procs["superlink"].poll() is None and time.time() < deadline, tails()
            time.sleep(0.5)
        for c in range(2):
            start(f"node_{c}", [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}",
                                "--port", str(free_port()), "--node-config",
                                f'silo="{silos / f"silo_{c}.h5"}" state-dir="{tmp_path / f"state_{c}"}"'])
        done = subprocess.run([str(BIN / "flwr"), "run", ".", "deploy", "--run-config", str(tmp_path / "run.toml")],
                              env=env, cwd=app, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "Successfully started run" in done.stdout, done.stdout + done.stderr
        deadline = time.time() + 400
        while not (out / "global_refreshed.h5").exists():
            assert time.time() < deadline and all(p.poll() is None for p in procs.values()), tails()
            time.sleep(1)
        time.sleep(1)
    finally:
        stop_process_groups(procs.values())

    import posterior_fusion

    kept = {p.read_bytes() for c in range(2) for p in (tmp_path / f"state_{c}").glob("[0-9a-f]*.h5")}
    received = [(out / f"client_{k}.h5").read_bytes() for k in range(2)]
    assert all(len(b) > LIMIT * 2 for b in received), [len(b) for b in received]
    assert set(received) == kept, "each node's artifact arrives as the node kept it, bit for bit"
    g = posterior_fusion.load(out / "global_refreshed.h5")
    refresh = g.metadata["federation"]["refresh"]
    assert refresh["bytes_down_per_node"] == (out / "global.h5").stat().st_size > LIMIT
    assert len(refresh["accepted"]) == 2 and refresh["left_out"] == []
    for k in range(2):
        theirs = posterior_fusion.load(out / "refresh" / f"client_{k}.h5")
        assert theirs.metadata["refreshed_at"]["file_sha256"] == posterior_fusion.load(out / "global.h5").sha256
