"""A file of ``--mib`` MiB moved through a local Flower deployment (one SuperLink, one SuperNode on localhost, no
TLS) the way a node's artifact travels (``posterior_fusion.flower.transfer``: a uint8 Array Flower sends in
content-addressed chunks, its SHA-256 checked on arrival), then the same bytes down again as the refresh round's
global does: seconds each way and the peak resident memory of every process (SuperLink, SuperNode, the ServerApp's
and the ClientApp's processes).

    .venv/bin/python benchmarks/flower_transfer.py --mib 1024 --json docs/results/federation_size/flower_transfer.json

The bytes are drawn from a seeded generator on the node; the server draws them again and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent

APP = '''
import hashlib
import json
import resource
import time

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from posterior_fusion.flower.transfer import message_content, received_file

clientapp = ClientApp()
serverapp = ServerApp()


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@clientapp.train()
def up(msg: Message, context: Context) -> Message:
    n = int(msg.content["config"]["bytes"])
    blob = np.random.default_rng(0).bytes(n)
    return Message(message_content("artifact", {"sent": time.time()}, {"artifact": blob}), reply_to=msg)


@clientapp.query()
def down(msg: Message, context: Context) -> Message:
    got = time.time()
    blob = received_file(msg.content, msg.content["refresh"], "global")
    return Message(message_content("artifact", {"received": got, "sha256": hashlib.sha256(blob).hexdigest(),
                                                "peak_mib": peak_mib()}, {}), reply_to=msg)


def ask(grid: Grid, content, node: int, kind: str) -> Message:
    [mid] = grid.push_messages([Message(content, dst_node_id=node, message_type=kind)])
    while True:
        for m in grid.pull_messages([mid]):
            return m
        time.sleep(0.2)


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n, out = int(cfg["bytes"]), str(cfg["out"])
    while not grid.get_node_ids():
        time.sleep(0.2)
    node = sorted(grid.get_node_ids())[0]
    t0 = time.time()
    reply = ask(grid, message_content("config", {"bytes": n}, {}), node, "train")
    t_up = time.time()
    blob = received_file(reply.content, reply.content["artifact"], "artifact")
    t_checked = time.time()
    same = blob == np.random.default_rng(0).bytes(n)
    t1 = time.time()
    back = ask(grid, message_content("refresh", {}, {"global": blob}), node, "query")
    t_down = time.time()
    rec = back.content["artifact"]
    result = {"bytes": n, "up_seconds": round(t_up - float(reply.content["artifact"]["sent"]), 1),
              "up_round_trip_seconds": round(t_up - t0, 1), "up_check_seconds": round(t_checked - t_up, 1),
              "up_bit_for_bit": same, "down_seconds": round(float(rec["received"]) - t1, 1),
              "down_round_trip_seconds": round(t_down - t1, 1),
              "down_bit_for_bit": rec["sha256"] == hashlib.sha256(blob).hexdigest(),
              "peak_mib": {"serverapp": round(peak_mib()), "clientapp": round(float(rec["peak_mib"]))}}
    with open(out, "w") as fh:
        json.dump(result, fh)
'''

PYPROJECT = '''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pfuse-transfer-bench"
version = "0.1.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "posterior-fusion"

[tool.flwr.app.components]
serverapp = "transfer_app:serverapp"
clientapp = "transfer_app:clientapp"

[tool.flwr.app.config]
bytes = 1
out = "result.json"
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_mib(pid: int) -> float:
    """VmHWM of a running process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="the file's size in MiB [default: 1024]")
    ap.add_argument("--json", type=Path, default=None, help="write the result here as JSON")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pfuse-transfer-"))
    app, home = tmp / "app", tmp / "flwr-home"
    app.mkdir()
    home.mkdir()
    (app / "transfer_app.py").write_text(APP)
    (app / "pyproject.toml").write_text(PYPROJECT)
    port = free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    procs = {}
    try:
        for name, cmd in (("superlink", [str(BIN / "flower-superlink"), "--insecure", "--port", str(port),
                                         "--disable-runtime-dependency-installation"]),
                          ("supernode", [str(BIN / "flower-supernode"), "--insecure", "--superlink",
                                         f"127.0.0.1:{port}", "--port", str(free_port())])):
            with open(tmp / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=app,
                                               start_new_session=True)
            time.sleep(5)
        result_file = tmp / "result.json"
        config = tmp / "run.toml"
        config.write_text(f'bytes = {args.mib << 20}\nout = "{result_file}"\n')
        done = subprocess.run([str(BIN / "flwr"), "run", ".", "local", "--run-config", str(config)], env=env,
                              cwd=app, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise SystemExit(f"flwr run failed: {done.stdout}{done.stderr}")
        deadline = time.time() + 3600
        while not result_file.exists():
            if time.time() > deadline or any(p.poll() is not None for p in procs.values()):
                raise SystemExit("the transfer did not finish; logs in " + str(tmp))
            time.sleep(1)
        time.sleep(1)
        result = json.loads(result_file.read_text())
        result["peak_mib"].update({name: round(peak_mib(p.pid)) for name, p in procs.items()})
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
