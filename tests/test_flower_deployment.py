"""A real Flower deployment on localhost: one ``flower-superlink`` and SuperNodes as separate
processes, TLS with certificates made here, SuperNode authentication, ``flwr run`` of
``examples/flower`` through a Flower connection config, and one SuperNode killed mid-round.

The server must fuse the two surviving nodes' artifacts and record the killed node as left out;
a fourth SuperNode whose key was never registered must not take part. About 1–2 minutes: Flower
reports a dead node after its heartbeat lapses (~1 minute).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed")  # scripts/setup.sh installs it

from conftest import free_port, stop_process_groups  # noqa: E402
from cryptography import x509  # noqa: E402  (a dependency of flwr)
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from posterior_fusion.data.silo import SiloData, write_silo  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower"
BIN = Path(sys.executable).parent


def make_certificates(folder: Path) -> None:
    """A throw-away CA and a server certificate for 127.0.0.1/localhost (ca.crt, server.pem, server.key)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pfuse test CA")])

    def build(subject, key, extensions):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(hours=2)))
        for ext, critical in extensions:
            b = b.add_extension(ext, critical=critical)
        return b.sign(ca_key, hashes.SHA256())

    ca = build(ca_name, ca_key, [(x509.BasicConstraints(ca=True, path_length=None), True)])
    server = build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), server_key,
                   [(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                  x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)])
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.pem").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """An OpenSSH ECDSA key pair, as ``flwr supernode register`` and ``--auth-supernode-private-key`` want."""
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH))
    return private, public


def clientapp_running(runtime_port: int) -> bool:
    """Whether a ``flwr-clientapp`` process serving the SuperNode on ``runtime_port`` exists."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "flwr-clientapp" in cmd and f"127.0.0.1:{runtime_port}" in cmd:
                return True
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and process groups (Linux)")
def test_superlink_three_tls_supernodes_one_killed_mid_round(tmp_path, fmnist_train):
    x, y = fmnist_train
    certs, keys, silos, out = (tmp_path / d for d in ("certs", "keys", "silos", "out"))
    for d in (certs, keys, silos):
        d.mkdir()
    make_certificates(certs)
    for c in range(3):
        write_silo(silos / f"silo_{c}.h5", SiloData(x[c * 400 : (c + 1) * 400], y[c * 400 : (c + 1) * 400],
                                                   "fmnist", 10))
    write_silo(silos / "val.h5", SiloData(x[-200:], y[-200:], "fmnist", 10))
    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app)
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{certs / "ca.crt"}"\n')
    (tmp_path / "run.toml").write_text(
        'model = "mlp"\nmodel-kwargs = \'{"hidden": 16}\'\ncomponents = 1\nstructure = "diag"\nepochs = 2\n'
        f'min-nodes = 3\nout-dir = "{out}"\nval = "{silos / "val.h5"}"\n"set.steps" = 20\n')
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PFUSE_PROGRESS": "0"}
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}

    def start(name: str, cmd: list[str]) -> None:
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "wb") as f:  # the child keeps its own handle
            procs[name] = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=app,
                                           start_new_session=True)

    def flwr(*args: str, timeout: float = 60) -> str:
        done = subprocess.run([str(BIN / "flwr"), *args], env=env, cwd=app, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"flwr {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def tails() -> str:
        return "\n".join(f"--- {n}\n" + p.read_text(errors="replace")[-1500:] for n, p in logs.items())

    try:
        start("superlink", [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"),
                            "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"),
                            "--port", str(port), "--enable-supernode-auth",
                            "--disable-runtime-dependency-installation"])
        deadline = time.time() + 60
        while "Uvicorn running on https://" not in logs["superlink"].read_text(errors="replace"):
            assert procs["superlink"].poll() is None and time.time() < deadline, tails()
            time.sleep(0.5)
        node_ports = {}
        for c in range(4):  # node 3's key is never registered: it must not join
            private, public = make_node_key(keys, f"node_{c}")
            if c < 3:
                flwr("supernode", "register", str(public), "deploy")
            node_ports[c] = free_port()
            start(f"node_{c}", [str(BIN / "flower-supernode"), "--root-certificates", str(certs / "ca.crt"),
                                "--superlink", f"127.0.0.1:{port}", "--port", str(node_ports[c]),
                                "--auth-supernode-private-key", str(private),
                                "--node-config", f'silo="{silos / f"silo_{c % 3}.h5"}"'])
        node_id = {}
        deadline = time.time() + 90
        while len(node_id) < 3:
            for c in range(3):
                for line in logs[f"node_{c}"].read_text(errors="replace").splitlines():
                    if "SuperNode ID:" in line:
                        node_id[c] = int(line.rsplit(":", 1)[1])
            assert time.time() < deadline, tails()
            time.sleep(0.5)

        started = flwr("run", ".", "deploy", "--run-config", str(tmp_path / "run.toml"))
        assert "Successfully started run" in started, started
        deadline = time.time() + 120
        while not clientapp_running(node_ports[2]):  # node 2 received the round's message ...
            assert time.time() < deadline, tails()
            time.sleep(0.2)
        os.killpg(procs["node_2"].pid, signal.SIGKILL)  # ... and dies before replying
        procs["node_2"].wait(timeout=30)

        deadline = time.time() + 300  # Flower reports the dead node after ~1 minute
        while not (out / "global.h5").exists():
            assert time.time() < deadline, tails()
            time.sleep(1)
        time.sleep(1)  # the atomic write has renamed the file: it is complete
    finally:
        stop_process_groups(procs.values())

    from posterior_fusion.artifact import load_global

    g = load_global(out / "global.h5")
    fed = g.metadata["federation"]
    assert fed["nodes"] == 3, "the unregistered SuperNode must not take part"
    clients = {d["node_id"]: d["file"] for d in fed["clients"]}
    assert set(clients) == {node_id[0], node_id[1]}
    assert [d["node_id"] for d in fed["left_out"]] == [node_id[2]]
    assert sorted(p.name for p in out.glob("client_*.h5")) == sorted(clients.values())
    assert len(g.members) == 1 and len(g.metadata["provenance"]) == 2
