"""Shared fixtures: small real Fashion-MNIST silos from the embedded subset, tiny artifacts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):  # the suite runs a worker per core and one more: one thread each (and in the
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # commands the tests start), not two workers × all cores
import torch as _torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    _torch.set_num_threads(1)

# Triton kernels run on the CPU through Triton's interpreter (set before triton is imported);
# on a machine with a GPU they run for real.
os.environ.setdefault("TRITON_INTERPRET", "0" if _torch.cuda.is_available() else "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import posterior_fusion  # noqa: E402
from posterior_fusion.artifact import write_client_artifact  # noqa: E402
from posterior_fusion.cli.main import pfuse  # noqa: E402
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron  # noqa: E402
from posterior_fusion.layout import ParameterLayout  # noqa: E402
from posterior_fusion.models import ModelSpec  # noqa: E402
from posterior_fusion.posterior import Component, frozen_mapping  # noqa: E402


@pytest.fixture(autouse=True)
def _own_data_folder(tmp_path_factory, monkeypatch):
    """Flower nodes keep their state under the user's data folder: the tests' own, never the machine's."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.getbasetemp() / "xdg-data"))


import math  # noqa: E402

import torch  # noqa: E402

from posterior_fusion.artifact import ClientPosterior  # noqa: E402
from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR, load_fmnist  # noqa: E402
from posterior_fusion.data.silo import SiloData, write_silo  # noqa: E402


def random_psd(n: int, gen: torch.Generator, rank: int | None = None) -> torch.Tensor:
    """Random symmetric PSD float64 ``(n, n)`` matrix (rank-deficient if ``rank < n``)."""
    X = torch.randn(n, rank or n + 2, generator=gen, dtype=torch.float64)
    return X @ X.T / X.shape[1]


@pytest.fixture(scope="session")
def fmnist_train() -> tuple[np.ndarray, np.ndarray]:
    return load_fmnist("train", EMBEDDED_FMNIST_DIR)


@pytest.fixture(scope="session")
def small_silo(fmnist_train) -> SiloData:
    x, y = fmnist_train
    return SiloData(x[:300], y[:300], "fmnist", 10)


def fit_artifact(path, silo: SiloData, structure: str = "kron", model: str = "mlp", kwargs: dict | None = None,
                 mixtures: int = 2, epochs: int = 1, seed: int = 0, init_seed: int = 0, swag: bool = False,
                 ggn: str = "exact", kfac: str = "expand"):
    """Run fit_components in-process and write the artifact; returns ``(metadata, components)``."""
    from posterior_fusion.artifact import write_client_artifact
    from posterior_fusion.layout import ParameterLayout
    from posterior_fusion.local.fit import fit_components
    from posterior_fusion.local.fit_config import FitConfig, TrainConfig
    from posterior_fusion.local.init import initial_weights
    from posterior_fusion.models import ModelSpec

    spec = ModelSpec(model, kwargs if kwargs is not None else ({"hidden": 16} if model == "mlp" else {}))
    cfg = FitConfig(structure=structure, train_seed=seed, ggn=ggn, kfac=kfac,
                    train=TrainConfig(epochs=epochs, batch_size=32, swag=swag, swag_rank=5))
    meta, comps = fit_components(spec, silo, initial_weights(spec, mixtures, init_seed), cfg, log=lambda *_: None)
    write_client_artifact(path, spec, ParameterLayout.from_model(spec.build()), meta, comps)
    return meta, comps


def fit_split(folder, silo: SiloData, clients: int, size: int, structure: str, name: str = "post", **kw) -> list:
    """Client c gets samples ``[c·size, (c+1)·size)`` of ``silo``; returns the artifact paths (``train_seed = c``)."""
    paths = []
    for c in range(clients):
        part = SiloData(silo.x[c * size : (c + 1) * size], silo.y[c * size : (c + 1) * size], "fmnist", 10)
        paths.append(folder / f"{name}_{c}.h5")
        fit_artifact(paths[-1], part, structure, seed=c, **kw)
    return paths


@pytest.fixture(scope="session")
def kron_artifact(tmp_path_factory, small_silo):
    path = tmp_path_factory.mktemp("art") / "kron.h5"
    fit_artifact(path, small_silo, "kron", swag=True)
    return path


def install_fake_plugin(folder, monkeypatch, package: str, version: str, entry: str, source: str) -> None:
    """A model plugin as pip would install it: ``folder/site/<package>`` with ``source`` and a
    dist-info registering ``entry = <package>:<entry>`` under ``posterior_fusion.models``."""
    site = folder / "site"
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(source)
    dist = site / f"{package}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text(f"[posterior_fusion.models]\n{entry} = {package}:{entry}\n")
    monkeypatch.syspath_prepend(str(site))


def dense_ggn_diagonal(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diag(Σ_n J_nᵀ H_n J_n) in float64 from full per-sample Jacobians (the independent reference)."""
    params = dict(model.named_parameters())
    out = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float64)
    for n in range(len(x)):
        def f(p, xn=x[n : n + 1]):
            return torch.func.functional_call(model, p, (xn,))[0]

        jac = torch.func.jacrev(f)(params)
        J = torch.cat([jac[k].reshape(jac[k].shape[0], -1) for k in params], 1)  # (C, d)
        p = f(params).softmax(-1)
        H = torch.diag(p) - torch.outer(p, p)
        out += ((J.T @ H) * J.T).sum(1)
    return out


def run_measured(args: list[str], timeout: float = 300):
    """Run the command ``args`` in a fresh process and return ``(completed process, its peak RSS in KiB)``: a
    wrapper interpreter reports the maximum resident size of its one child, so other processes the test worker
    started before do not count."""
    import subprocess
    import sys

    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", wrapper, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    lines = r.stderr.strip().splitlines()
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout, "\n".join(lines[:-1]) + "\n" if lines[:-1] else ""), \
        int(lines[-1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a deployment test's SuperLink or SuperNode)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_groups(procs) -> None:
    """Stop every process started with ``start_new_session=True`` and its children: SIGTERM to each group,
    then SIGKILL to those still running after 20 s."""
    import signal
    import subprocess

    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


# The published JSON Schema of the artifact header and a small validator for the keywords it uses
SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "docs" / "artifact-header.schema.json").read_text())


def check(value, schema, path="$"):
    """Validate ``value`` against a JSON Schema using: type, const, enum, required, properties,
    additionalProperties (false), items, min/maxItems, minimum, maximum, maxLength, pattern."""
    t = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float)}
    if t and (not isinstance(value, types[t]) or isinstance(value, bool)):
        raise AssertionError(f"{path}: expected {t}, got {type(value).__name__}")
    if "const" in schema and value != schema["const"]:
        raise AssertionError(f"{path}: expected {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise AssertionError(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise AssertionError(f"{path}: missing {key!r}")
        props = schema.get("properties", {})
        for key, v in value.items():
            if key in props:
                check(v, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                raise AssertionError(f"{path}: unexpected {key!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", 10**9):
            raise AssertionError(f"{path}: {len(value)} items out of range")
        for i, v in enumerate(value):
            if "items" in schema:
                check(v, schema["items"], f"{path}[{i}]")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", -float("inf")) or value > schema.get("maximum", float("inf")):
            raise AssertionError(f"{path}: {value} out of range")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", 10**9) or ("pattern" in schema and not re.match(schema["pattern"], value)):
            raise AssertionError(f"{path}: {value!r} does not match")



RSS_WRAPPER = ("import sys, atexit; atexit.register(lambda: sys.stderr.write('MAXRSS %s\\n' % next("
               "l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))); "
               "from posterior_fusion.cli.main import main; main()")


@pytest.fixture()
def silo_file(tmp_path, small_silo) -> Path:
    path = tmp_path / "silo.h5"
    write_silo(path, SiloData(small_silo.x[:60], small_silo.y[:60], "fmnist", 10))
    return path


@pytest.fixture(scope="module")
def two_clients(tmp_path_factory, small_silo) -> list[Path]:
    folder = tmp_path_factory.mktemp("clients3")
    return [Path(p) for p in fit_split(folder, small_silo, 2, 80, "kron", name="c")]


def cli(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


def one_error_line(r) -> str:
    """The result of a refused command: exit 2, one ``error:`` line, no traceback."""
    err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode()
    lines = [ln for ln in err.splitlines() if not ln.startswith("MAXRSS ")]
    code = r.exit_code if hasattr(r, "exit_code") else r.returncode
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def child(*args, timeout: int = 120) -> tuple[subprocess.CompletedProcess, int]:
    """The CLI in a child process (a hang fails the test); returns it and its peak RSS in MiB."""
    proc = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    rss = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("MAXRSS ")]
    return proc, (rss[-1] // 1024 if rss else -1)


TINY_SPEC = ModelSpec("mlp", {"in_features": 6, "num_classes": 3, "hidden_sizes": [], "bias": True})


TINY_META = {"n_data": 30, "class_counts": [10, 10, 10], "temperature": 1.0, "prior_precision": 1.0, "structure": "kron"}


def kron_component(B: torch.Tensor, A: torch.Tensor) -> Component:
    layout = ParameterLayout.from_model(TINY_SPEC.build())
    return Component(0, torch.zeros(layout.dim), BlockDiag([Kron(B, A), Diag(torch.ones(3))]),
                     frozen_mapping({"seed": 0}), 1.0, 1.0)


def poisoned_copy(src, dst, curvature_scale=1.0, map_noise=0.0):
    art = posterior_fusion.load(src)
    gen = torch.Generator().manual_seed(0)
    comps = []
    for c in art.components:
        blocks = []
        for b in c.curvature.blocks:
            if isinstance(b, Kron):
                blocks.append(Kron(b.B * curvature_scale, b.A))
            elif isinstance(b, Dense):
                blocks.append(Dense(b.G * curvature_scale))
            else:
                blocks.append(Diag(b.g * curvature_scale))
        w = c.map + map_noise * torch.randn(c.map.shape, generator=gen)
        comps.append(Component(c.index, w, BlockDiag(blocks), dict(c.training), c.temperature, c.prior_precision))
    write_client_artifact(dst, art.model_spec, art.layout, dict(art.metadata, poisoned=True), comps)
    return dst


@pytest.fixture(scope="module")
def honest(tmp_path_factory, small_silo):
    folder = tmp_path_factory.mktemp("honest")
    return folder, fit_split(folder, small_silo, 4, 75, "kron", mixtures=2, epochs=2)


# Tiny fusion clients: the fusion and method tests' inputs against dense references.

TINY = ModelSpec("mlp", {"in_features": 4, "hidden": 3, "num_classes": 2, "bias": True})
TINY_LAYOUT = ParameterLayout.from_model(TINY.build())  # W1 (3,4), b1 (3,), W2 (2,3), b2 (2,)


def client(comps: list[Component], structure: str, n: int = 10, T: float = 0.5, lam: float = 2.0,
           spec: ModelSpec = TINY, layout: ParameterLayout = TINY_LAYOUT, name: str = "c") -> ClientPosterior:
    meta = {"n_data": n, "temperature": T, "prior_precision": lam, "structure": structure,
            "num_components": len(comps), "class_counts": [n] + [0] * (spec.num_classes - 1)}
    return ClientPosterior(name, name + "-sha", spec, layout, frozen_mapping(meta), tuple(comps))


def random_curvature(structure: str, gen: torch.Generator) -> BlockDiag:
    if structure == "diag":
        return BlockDiag([Diag(torch.rand(TINY_LAYOUT.dim, generator=gen, dtype=torch.float64) * 2)])
    blocks = []
    for e in TINY_LAYOUT.entries:
        if e.matrix_shape:
            out, inn = e.matrix_shape
            blocks.append(Kron(random_psd(out, gen), random_psd(inn, gen)))
        else:
            blocks.append(Dense(random_psd(e.size, gen)))
    return BlockDiag(blocks)


def random_clients(structure: str, C: int, M: int, seed: int, T: float = 0.5, lam: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in range(C):
        comps = [Component(m, torch.randn(TINY_LAYOUT.dim, generator=gen, dtype=torch.float64),
                           random_curvature(structure, gen), {}, T, lam) for m in range(M)]
        out.append(client(comps, structure, n=10 + c, T=T, lam=lam, name=f"c{c}"))
    return out


def dense_neg_log_posterior(clients, w, T, lams, lam0, centre=None):
    """Independent float64 reference built from dense matrices and torch.distributions; ``centre``:
    the mean of every prior (the global one and each client's divided-out one; default zero)."""
    d = w.shape[-1]
    mu0 = torch.zeros(d, dtype=torch.float64) if centre is None else centre.double()
    total = torch.distributions.MultivariateNormal(mu0,
                                                   precision_matrix=lam0 * torch.eye(d, dtype=torch.float64)).log_prob(w)
    for c, lam in zip(clients, lams):
        logs = []
        for comp in c.components:
            G = torch.block_diag(*[b.to_dense() for b in comp.curvature.blocks])
            P = G / T + lam * torch.eye(d, dtype=torch.float64)
            logs.append(torch.distributions.MultivariateNormal(comp.map, precision_matrix=P).log_prob(w) - math.log(len(c.components)))
        p0c = torch.distributions.MultivariateNormal(mu0, precision_matrix=lam * torch.eye(d, dtype=torch.float64))
        total = total + torch.logsumexp(torch.stack(logs), 0) - p0c.log_prob(w)
    return -total


def linear_gaussian_clients(C: int = 3, p: int = 5, sigma2: float = 0.5, lam: float = 2.0, seed: int = 0):
    """Bayesian linear regression silos; returns clients (exact Gaussian posteriors) and the pooled posterior."""
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(p, generator=gen, dtype=torch.float64)
    spec = ModelSpec("mlp", {"in_features": p, "hidden": 1, "num_classes": 1, "bias": False})
    layout = ParameterLayout.from_shapes([("w", (p,))])
    clients, XtX, Xty = [], torch.zeros(p, p, dtype=torch.float64), torch.zeros(p, dtype=torch.float64)
    for c in range(C):
        n = 4 + 3 * c
        X = torch.randn(n, p, generator=gen, dtype=torch.float64) * (1 + c)
        y = X @ w_true + math.sqrt(sigma2) * torch.randn(n, generator=gen, dtype=torch.float64)
        G = X.T @ X / sigma2
        Lc = G + lam * torch.eye(p, dtype=torch.float64)
        w_c = torch.linalg.solve(Lc, X.T @ y / sigma2)
        XtX += X.T @ X
        Xty += X.T @ y
        clients.append(client([Component(0, w_c, BlockDiag([Dense(G)]), {}, 1.0, lam)], "diag+full", n=n, T=1.0,
                              lam=lam, spec=spec, layout=layout, name=f"lin{c}"))
    L = XtX / sigma2 + lam * torch.eye(p, dtype=torch.float64)
    return clients, torch.linalg.solve(L, Xty / sigma2), L


def hand_clients(maps, diags, ns, structure="diag"):
    layout = ParameterLayout.from_shapes([("w", (len(maps[0]),))])
    spec = ModelSpec("mlp", {"in_features": 1, "hidden": 1, "num_classes": 1, "bias": False})
    return [client([Component(0, torch.tensor(m), BlockDiag([Diag(torch.tensor(g))]), {}, 1.0, 1.0)],
                   structure, n=n, spec=spec, layout=layout, name=f"h{i}")
            for i, (m, g, n) in enumerate(zip(maps, diags, ns))]


@pytest.fixture(scope="session")
def fitted(tmp_path_factory, small_silo):
    folder = tmp_path_factory.mktemp("fuse")
    x, y = small_silo.x, small_silo.y
    from posterior_fusion.data.silo import SiloData, write_silo

    paths = []
    for c in range(3):
        silo = SiloData(x[c * 100 : (c + 1) * 100], y[c * 100 : (c + 1) * 100], "fmnist", 10)
        paths.append(folder / f"post_{c}.h5")
        fit_artifact(paths[-1], silo, "kron", mixtures=2, seed=c, swag=True)
    write_silo(folder / "val.h5", SiloData(x[-100:], y[-100:], "fmnist", 10))
    fit_artifact(folder / "diag_0.h5", SiloData(x[:100], y[:100], "fmnist", 10), "diag", mixtures=2)
    fit_artifact(folder / "lenet.h5", SiloData(x[:50], y[:50], "fmnist", 10), "diag", model="lenet", mixtures=1)
    fit_artifact(folder / "m3.h5", SiloData(x[:50], y[:50], "fmnist", 10), "kron", mixtures=3)
    return folder, paths


def raw_tensors(block):
    if isinstance(block, Kron):
        return block.B, block.A
    if isinstance(block, Dense):
        return (block.G,)
    return (block.g,)


def diag_full_random_clients(C: int, M: int, seed: int):
    """Random diag+full clients on TINY: a diagonal block over W1, b1 and a dense block over W2, b2."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in range(C):
        comps = [Component(m, torch.randn(TINY_LAYOUT.dim, generator=gen, dtype=torch.float64),
                           BlockDiag([Diag(torch.rand(15, generator=gen, dtype=torch.float64)),
                                      Dense(random_psd(TINY_LAYOUT.dim - 15, gen))]), {}, 0.5, 2.0)
                 for m in range(M)]
        out.append(client(comps, "diag+full", n=10 + c, name=f"c{c}"))
    return out


def structured_clients(structure: str, C: int, M: int, seed: int):
    return diag_full_random_clients(C, M, seed) if structure == "diag+full" else random_clients(structure, C, M, seed)
