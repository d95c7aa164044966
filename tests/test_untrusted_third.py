"""Third security pass (docs/security.md): one rule per class, each tested with several
constructions of our own — writing where nobody asked, hangs, unbounded memory, non-finite
outputs, tracebacks, and strings from files reaching the terminal."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import fit_split

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact, write_global_artifact
from posterior_fusion.artifact.writer import text_attr, write_predictions
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import ConfigError, NonFiniteOutputError, OutputError, PfuseError, shown, terminal_safe
from posterior_fusion.experiment.grid_config import ExperimentConfig
from posterior_fusion.files import atomic_folder, write_atomically
from posterior_fusion.posterior import Component

SECRET = b"precious user data\n"
# VmHWM (this program's own peak; getrusage's ru_maxrss would include the forking pytest's size)
RSS_WRAPPER = ("import sys, atexit; atexit.register(lambda: sys.stderr.write('MAXRSS %s\\n' % next("
               "l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))); "
               "from posterior_fusion.cli.main import main; main()")


def cli(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


def child(*args, timeout: int = 120) -> tuple[subprocess.CompletedProcess, int]:
    """The CLI in a child process (a hang fails the test); returns it and its peak RSS in MiB."""
    proc = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)
    rss = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("MAXRSS ")]
    return proc, (rss[-1] // 1024 if rss else -1)


def one_error_line(r) -> str:
    """The result of a refused command: exit 2, one ``error:`` line, no traceback."""
    err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode()
    lines = [ln for ln in err.splitlines() if not ln.startswith("MAXRSS ")]
    code = r.exit_code if hasattr(r, "exit_code") else r.returncode
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture()
def silo_file(tmp_path, small_silo) -> Path:
    path = tmp_path / "silo.h5"
    write_silo(path, SiloData(small_silo.x[:60], small_silo.y[:60], "fmnist", 10))
    return path


@pytest.fixture(scope="module")
def two_clients(tmp_path_factory, small_silo) -> list[Path]:
    folder = tmp_path_factory.mktemp("clients3")
    return [Path(p) for p in fit_split(folder, small_silo, 2, 80, "kron", name="c")]


def _secret(tmp_path) -> Path:
    target = tmp_path / "elsewhere" / "victim.txt"
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(SECRET)
    return target


# ------------------------------------------------------------------ 1. writing where nobody asked


def _plant_links(out: Path, target: Path) -> None:
    """Links at every name an attacker could predict beside ``out``: the old temporary and probe
    names for pids around ours, and the output itself."""
    pid = os.getpid()
    for p in range(pid - 5, pid + 50):
        for name in (f".{out.name}.tmp-{p}", f".{out.name}.probe-{p}", f".{out.name}.incoming"):
            link = out.parent / name
            if not link.exists() and not link.is_symlink():
                link.symlink_to(target)


@pytest.mark.parametrize("writer", ["import-data", "predict", "fuse", "evaluate --plot"])
def test_planted_links_beside_an_output_never_reach_their_target(tmp_path, writer, two_clients, silo_file):
    target = _secret(tmp_path)
    out_dir = tmp_path / "shared"
    out_dir.mkdir()
    out = out_dir / ("fig.png" if writer == "evaluate --plot" else "out.h5")
    _plant_links(out, target)
    out.symlink_to(target)  # the output name itself is a planted link
    if writer == "import-data":
        np.savez(tmp_path / "d.npz", x=np.zeros((5, 3), np.float32), y=np.array([0, 1, 0, 1, 0]))
        r = cli("import-data", tmp_path / "d.npz", "--out", out)
    else:
        g = tmp_path / "g.h5"
        assert cli("fuse", *two_clients, "--method", "fedavg", "--out", g).exit_code == 0
        if writer == "fuse":
            r = cli("fuse", *two_clients, "--method", "fedavg", "--out", out)
        elif writer == "predict":
            r = cli("predict", g, "--data", silo_file, "--out", out)
        else:
            r = cli("evaluate", g, "--data", silo_file, "--plot", out)
    assert r.exit_code == 0, r.stderr
    assert target.read_bytes() == SECRET                       # the link's target is untouched
    assert out.is_file() and not out.is_symlink()              # the output is a new regular file
    assert out.read_bytes() != SECRET


def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path, silo_file):
    target = _secret(tmp_path)
    out = tmp_path / "o.h5"
    (tmp_path / ".o.h5.lock").symlink_to(target)
    line = one_error_line(cli("fit-local", "--data", silo_file, "--model", "mlp", "--epochs", "1", "-M", "1",
                              "--out", out))
    assert "symbolic link" in line and target.read_bytes() == SECRET and not out.exists()


def test_the_private_temporary_folder_is_fresh_and_never_followed(tmp_path):
    target = _secret(tmp_path)
    seen = []

    def produce(tmp: Path) -> None:
        seen.append(tmp)
        assert tmp.parent.stat().st_mode & 0o777 == 0o700 and not tmp.exists()
        tmp.write_bytes(b"new")

    (tmp_path / "x.bin").symlink_to(target)
    write_atomically(tmp_path / "x.bin", produce)
    write_atomically(tmp_path / "x.bin", produce)
    assert seen[0].parent != seen[1].parent  # unpredictable names
    assert (tmp_path / "x.bin").read_bytes() == b"new" and target.read_bytes() == SECRET
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "x.bin"]  # nothing left behind


@pytest.mark.parametrize("case", ["fit-local same path", "fit-local hard link", "import-data via link",
                                  "predict onto its data", "fuse onto a client", "recapture onto its silo"])
def test_an_output_that_is_one_of_the_inputs_is_refused(tmp_path, case, silo_file, two_clients):
    silo_before = silo_file.read_bytes()
    if case == "fit-local same path":
        r = cli("fit-local", "--data", silo_file, "--model", "mlp", "--epochs", "1", "--out", silo_file)
    elif case == "fit-local hard link":
        os.link(silo_file, tmp_path / "alias.h5")
        r = cli("fit-local", "--data", silo_file, "--model", "mlp", "--epochs", "1", "--out", tmp_path / "alias.h5")
    elif case == "import-data via link":
        np.save(tmp_path / "x.npy", np.zeros((4, 2), np.float32))
        (tmp_path / "link.npy").symlink_to(tmp_path / "x.npy")
        before = (tmp_path / "x.npy").read_bytes()
        r = cli("import-data", tmp_path / "x.npy", "--out", tmp_path / "link.npy")
        assert (tmp_path / "x.npy").read_bytes() == before
    elif case == "predict onto its data":
        g = tmp_path / "g.h5"
        assert cli("fuse", *two_clients, "--method", "fedavg", "--out", g).exit_code == 0
        r = cli("predict", g, "--data", silo_file, "--out", silo_file)
    elif case == "fuse onto a client":
        before = two_clients[1].read_bytes()
        r = cli("fuse", *two_clients, "--method", "fedavg", "--out", two_clients[1])
        assert two_clients[1].read_bytes() == before
    else:
        r = cli("recapture", "--artifact", two_clients[0], "--data", silo_file, "--structure", "diag", "--out", silo_file)
    assert "is also an input" in one_error_line(r)
    assert silo_file.read_bytes() == silo_before


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", "", "x" * 101, "/abs"])
def test_experiment_names_are_one_folder_name(tmp_path, name):
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"name = {json.dumps(name)}\n")
    with pytest.raises(ConfigError, match="one folder name"):
        ExperimentConfig.from_toml(cfg)


def test_a_partition_killed_half_way_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    from posterior_fusion.data import prepare

    out = tmp_path / "split"
    args = dict(clients=3, alpha=0.5, partition_seed=0, val_size=50, max_train=600)
    prepare.partition_to_files(out, **args)
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []
    real = prepare.write_silo

    def dies_on_third(path, data):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed half-way
        real(path, data)

    monkeypatch.setattr(prepare, "write_silo", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare.partition_to_files(out, **dict(args, partition_seed=1))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # never a mix of two splits
    assert [p.name for p in tmp_path.iterdir()] == ["split"]           # nothing half-written beside it
    monkeypatch.setattr(prepare, "write_silo", real)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="did not write"):
        prepare.partition_to_files(out, **dict(args, partition_seed=2))
    assert (out / "notes.txt").read_text() == "mine"


def test_atomic_folder_refuses_a_link_and_a_file(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("x")
    for name in ("link", "file"):
        with pytest.raises(OutputError), atomic_folder(tmp_path / name, owned=lambda n: True):
            pass


# ------------------------------------------------------------------ 2. hangs


@pytest.mark.parametrize("fmt", ["npz", "npy", "csv", "idx", "hdf5", "svhn", "image-folder", "cifar10", "silo"])
def test_fifos_are_refused_not_opened(tmp_path, fmt):
    fifo = tmp_path / ("in." + {"image-folder": "png", "cifar10": "bin", "silo": "h5"}.get(fmt, fmt))
    if fmt == "image-folder":
        (tmp_path / "imgs" / "cat").mkdir(parents=True)
        fifo = tmp_path / "imgs" / "cat" / "0.png"
        source = tmp_path / "imgs"
    elif fmt == "cifar10":
        (tmp_path / "cifar").mkdir()
        fifo = tmp_path / "cifar" / "data_batch_1.bin"
        source = tmp_path / "cifar"
    else:
        source = fifo
    os.mkfifo(fifo)
    if fmt == "silo":
        proc, _ = child("fit-local", "--data", source, "--model", "mlp", "--out", tmp_path / "o.h5", timeout=60)
    else:
        proc, _ = child("import-data", source, "--format", fmt, "--out", tmp_path / "o.h5", timeout=60)
    assert "FIFO" in one_error_line(proc)


def test_many_distinct_label_names_import_in_linear_time(tmp_path):
    n = 90_000
    lines = ["f,label"] + [f"{i % 7},name{i}" for i in range(n)]
    (tmp_path / "many.csv").write_text("\n".join(lines) + "\n")
    proc, _ = child("import-data", tmp_path / "many.csv", "--num-classes", str(n), "--out", tmp_path / "o.h5",
                    timeout=120)  # quadratic would not finish
    assert proc.returncode == 0, proc.stderr


def test_inspect_of_many_links_to_one_big_attribute_is_refused(tmp_path, kron_artifact):
    for i, (count, size) in enumerate(((300, 10), (40, 3_900_000))):
        bad = tmp_path / f"links{i}.h5"
        with h5py.File(kron_artifact) as src, h5py.File(bad, "w") as f:
            for key, value in src.attrs.items():
                f.attrs[key] = value
            g = f.create_group("components")
            src.copy(src["components/0"], g, "0")
            g["0"].attrs["training"] = text_attr(json.dumps({"pad": "x" * size}))
            for k in range(1, count):
                g[str(k)] = g["0"]  # hard links to one group and its large attribute
        proc, _ = child("inspect", bad, timeout=120)
        assert "more than" in one_error_line(proc) or "exceed" in one_error_line(proc)


@pytest.mark.parametrize("args", [("--set", "steps=1000000000000"), ("--set", "adam_lr=inf"),
                                  ("--temperature", "1e300"), ("--prior-var", "inf"), ("--prior-var", "nan")])
def test_unbounded_settings_are_refused_before_any_work(two_clients, tmp_path, args):
    line = one_error_line(cli("fuse", *two_clients, "--method", "fedbens", *args, "--out", tmp_path / "g.h5"))
    assert ("must be" in line or "not in the range" in line or "not a number in the range" in line)
    assert not (tmp_path / "g.h5").exists()


@pytest.mark.parametrize("body", ["alphas = [" + ", ".join(["0.1"] * 5000) + "]",
                                  "seeds = [" + ", ".join(map(str, range(100))) + "]\nalphas = [0.1, 0.2]",
                                  "methods = [" + ", ".join(['"fedavg"'] * 70) + "]"])
def test_huge_grids_are_refused_before_allocation(tmp_path, body):
    (tmp_path / "g.toml").write_text(body + "\n")
    with pytest.raises(ConfigError, match="too large"):
        ExperimentConfig.from_toml(tmp_path / "g.toml")


# ------------------------------------------------------------------ 3. memory bounded


def _npy_header(shape, dtype="<f4") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _png_declaring(path: Path, width: int, height: int) -> None:
    """A tiny PNG whose header declares ``width`` x ``height`` pixels."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, format="PNG")
    raw = bytearray(buf.getvalue())
    ihdr = raw.index(b"IHDR")
    raw[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(raw[ihdr : ihdr + 17])) & 0xFFFFFFFF
    raw[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    path.write_bytes(bytes(raw))


def _over_budget_sources(tmp_path: Path) -> dict[str, Path]:
    out = {}
    # npz: a member whose header declares 6 GB, stored in a few bytes (a zip "bomb" of declared size)
    import zipfile

    with zipfile.ZipFile(tmp_path / "bomb.npz", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", _npy_header((50_000, 3, 100, 100)) + b"\0" * 1000)
    out["npz"] = tmp_path / "bomb.npz"
    (tmp_path / "big.npy").write_bytes(_npy_header((20_000, 10_000)) + b"\0" * 64)
    out["npy"] = tmp_path / "big.npy"
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    _png_declaring(tmp_path / "imgs" / "a" / "0.png", 40_000, 40_000)
    out["image-folder"] = tmp_path / "imgs"
    with gzip.open(tmp_path / "big-idx3-ubyte.gz", "wb") as fh:  # header: 1,000,000 images of 64x64
        fh.write(struct.pack(">HBB", 0, 8, 3) + struct.pack(">3I", 1_000_000, 64, 64) + b"\0" * 4096)
    out["idx"] = tmp_path / "big-idx3-ubyte.gz"
    from scipy.io import savemat

    savemat(tmp_path / "big.mat", {"X": np.zeros((32, 32, 3, 40_000), np.uint8), "y": np.ones((40_000, 1))},
            do_compression=True)
    out["svhn"] = tmp_path / "big.mat"
    with h5py.File(tmp_path / "big.h5", "w") as f:
        f.create_dataset("x", data=np.zeros((40_000, 3, 32, 32), np.uint8), compression="gzip", chunks=(1000, 3, 32, 32))
    out["hdf5"] = tmp_path / "big.h5"
    return out


def test_over_budget_sources_are_refused_before_allocation(tmp_path):
    for fmt, source in _over_budget_sources(tmp_path).items():
        proc, rss = child("import-data", source, "--format", fmt, "--max-memory", "64M", "--out", tmp_path / "o.h5")
        line = one_error_line(proc)
        assert any(k in line for k in ("over the limit", "memory limit", "compression bomb")), (fmt, line)
        assert rss < 400, (fmt, rss)  # MiB: the interpreter and numpy, never the declared data


@pytest.mark.parametrize("kwargs", ['{"in_features": 784, "hidden_sizes": [30000, 30000]}',
                                    '{"in_features": 784, "hidden_sizes": [6000, 6000]}',
                                    '{"in_features": 1000000, "hidden_sizes": [100]}'])
def test_model_kwargs_bombs_are_refused_before_allocation(tmp_path, kwargs, silo_file):
    for cmd in (["init", "--out", tmp_path / "i.h5"], ["fit-local", "--data", silo_file, "--out", tmp_path / "o.h5"]):
        proc, rss = child(*cmd, "--model", "mlp", "--model-kwargs", kwargs, "--max-memory", "256M")
        line = one_error_line(proc)
        assert "parameters" in line and ("over the cap" in line or "over the limit" in line)
        assert rss < 700, rss  # torch's own import; never the model


def test_evaluate_bins_are_bounded(tmp_path, two_clients, silo_file):
    g = tmp_path / "g.h5"
    assert cli("fuse", *two_clients, "--method", "fedavg", "--out", g).exit_code == 0
    for bins in ("1000000000", "0", "-3"):
        assert "bins" in one_error_line(cli("evaluate", g, "--data", silo_file, "--bins", bins))


def test_glm_predictive_stays_under_the_budget(tmp_path, two_clients, small_silo):
    """The GLM predictive on 2,000 images under --max-memory: the run succeeds, its peak stays
    under the limit, and a limit too small for one batch is refused in one line."""
    test = tmp_path / "test.h5"
    write_silo(test, SiloData(small_silo.x[:2000], small_silo.y[:2000], "fmnist", 10))
    g = tmp_path / "g.h5"
    assert cli("fuse", *two_clients, "--method", "fedbens", "--set", "steps=5", "--out", g).exit_code == 0
    proc, rss = child("evaluate", g, "--data", test, "--predictive", "glm", "--max-memory", "700M", "--json")
    assert proc.returncode == 0, proc.stderr
    assert rss < 700, rss
    proc, _ = child("evaluate", g, "--data", test, "--predictive", "glm", "--max-memory", "1M")
    assert "over the limit" in one_error_line(proc)


# ------------------------------------------------------------------ 4. outputs are finite


def test_writers_refuse_non_finite_numbers_and_name_the_step(tmp_path, kron_artifact):
    art = posterior_fusion.load(kron_artifact)
    c = art.components[0]
    for value, step in ((c.map * float("nan"), "training"),
                        (c.map * 1e39, "training")):
        bad = Component(0, value.float(), c.curvature, c.training, c.temperature, c.prior_precision)
        with pytest.raises(NonFiniteOutputError, match=step):
            write_client_artifact(tmp_path / "c.h5", art.model_spec, art.layout, dict(art.metadata), [bad])
    with pytest.raises(NonFiniteOutputError, match="fusion"):
        write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"method": "x"},
                              [c.map.double() * 1e300])
    with pytest.raises(NonFiniteOutputError, match="metadata.history"):
        write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"history": [float("inf")]}, [c.map])
    for probs in (torch.full((3, 2), float("nan")), torch.tensor([[-1.0, 2.0]]), torch.tensor([[0.2, 0.2]])):
        with pytest.raises(NonFiniteOutputError, match="not probabilities"):
            write_predictions(tmp_path / "p.h5", probs, {"predictive": "mc"})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("transform", [{"scale": 1e-300, "mean": [0.0], "std": [1.0]},
                                       {"scale": 1.0, "mean": [0.0], "std": [1e-30]},
                                       {"scale": 1e300, "mean": [0.0], "std": [1.0]},
                                       {"scale": 1.0, "mean": [1e200], "std": [1.0]}])
def test_transforms_that_make_inf_or_nan_are_refused(tmp_path, silo_file, transform):
    with h5py.File(silo_file, "r+") as f:
        f.attrs["transform"] = np.bytes_(json.dumps(transform).encode())
    line = one_error_line(cli("fit-local", "--data", silo_file, "--model", "mlp", "--out", tmp_path / "o.h5"))
    assert "transform" in line and not (tmp_path / "o.h5").exists()


def test_data_that_a_transform_overflows_is_refused_at_import(tmp_path):
    np.savez(tmp_path / "huge.npz", x=np.array([[3e38, -3e38], [1.0, 2.0]], np.float32), y=np.array([0, 1]))
    for transform in ("auto", "none"):
        line = one_error_line(cli("import-data", tmp_path / "huge.npz", "--transform", transform,
                                  "--out", tmp_path / "o.h5"))
        assert "transform" in line
    np.savez(tmp_path / "black.npz", x=np.zeros((3000, 28, 28), np.uint8), y=np.zeros(3000, np.int64))
    assert cli("import-data", tmp_path / "black.npz", "--out", tmp_path / "black.h5").exit_code == 0  # all black
    from posterior_fusion.data.silo import read_silo

    assert read_silo(tmp_path / "black.h5").x.shape == (3000, 28, 28)  # the reader accepts what the writer wrote


@pytest.mark.parametrize("weights", ["[-1, 2]", "[1e999, 0]", '["a", "b"]', "[0.5]", "[0.2, 0.2]"])
def test_global_mode_weights_must_be_probabilities(tmp_path, two_clients, weights, silo_file):
    g = tmp_path / "g.h5"
    assert cli("fuse", *two_clients, "--method", "fedbens", "--set", "steps=2", "--set", "modes=2",
               "--out", g).exit_code == 0
    with h5py.File(g, "r+") as f:
        meta = json.loads(bytes(f.attrs["metadata"]).decode())
        text = json.dumps(meta).replace(f'"num_members": {meta["num_members"]}',
                                        f'"mode_weights": {weights}, "num_members": {meta["num_members"]}')
        f.attrs["metadata"] = text_attr(text)
    line = one_error_line(cli("predict", g, "--data", silo_file, "--out", tmp_path / "p.h5"))
    assert "mode_weights" in line or "infinity" in line


def test_a_global_posterior_without_its_prior_is_refused(tmp_path, two_clients, silo_file):
    g = tmp_path / "g.h5"
    assert cli("fuse", *two_clients, "--method", "fedbens", "--set", "steps=2", "--out", g).exit_code == 0
    original = g.read_bytes()
    for change in (lambda m: m.pop("laplace"), lambda m: m["laplace"].update(prior_precision=1e-300)):
        g.write_bytes(original)
        with h5py.File(g, "r+") as f:
            meta = json.loads(bytes(f.attrs["metadata"]).decode())
            change(meta)
            f.attrs["metadata"] = text_attr(json.dumps(meta))
        assert "laplace" in one_error_line(cli("predict", g, "--data", silo_file, "--predictive", "glm",
                                                "--out", tmp_path / "p.h5"))


# ------------------------------------------------------------------ 5. tracebacks


def _hostile_sources(tmp_path: Path) -> list[tuple[str, list[str]]]:
    (tmp_path / "long.csv").write_text("a,b,label\n1,2,0\n1,2,3,0\n")
    (tmp_path / "overflow.csv").write_text("a,label\n1,0\n2,99999999999999999999999\n")
    (tmp_path / "neg.csv").write_text("a,label\n1,-4\n")
    (tmp_path / "huge-labels.npz").write_bytes(b"")
    np.savez(tmp_path / "huge-labels.npz", x=np.zeros((3, 2), np.float32), y=np.array([0, 1, 10**9]))
    np.savez(tmp_path / "mismatch.npz", x=np.zeros((3, 2), np.float32), y=np.array([0, 1]))
    (tmp_path / "trunc.npy").write_bytes(_npy_header((10, 10)) + b"\0" * 7)
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04" + os.urandom(200))
    from scipy.io import savemat

    savemat(tmp_path / "empty.mat", {})
    savemat(tmp_path / "wrong.mat", {"X": np.zeros((4, 4)), "y": np.zeros((4, 1))})
    with gzip.open(tmp_path / "rank1-idx3-ubyte.gz", "wb") as fh:
        fh.write(struct.pack(">HBB", 0, 8, 1) + struct.pack(">I", 5) + b"\1" * 5)
    with gzip.open(tmp_path / "zero-idx3-ubyte.gz", "wb") as fh:
        fh.write(struct.pack(">HBB", 0, 8, 3) + struct.pack(">3I", 2**31, 2**31, 0))
    with h5py.File(tmp_path / "group-y.h5", "w") as f:
        f["x"] = np.zeros((3, 2), np.float32)
        f.create_group("y")
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "a" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(100))
    return [("long.csv", []), ("overflow.csv", []), ("neg.csv", []), ("huge-labels.npz", []), ("mismatch.npz", []),
            ("trunc.npy", []), ("junk.npz", []), ("empty.mat", []), ("wrong.mat", []), ("rank1-idx3-ubyte.gz", []),
            ("zero-idx3-ubyte.gz", []), ("group-y.h5", []), ("imgs", []), ("imgs", ["--image-size", "0x7"]),
            ("imgs", ["--image-size", "99999x2"])]


def test_hostile_import_sources_end_in_one_line(tmp_path):
    for name, extra in _hostile_sources(tmp_path):
        r = cli("import-data", tmp_path / name, *extra, "--out", tmp_path / "o.h5")
        assert r.exception is None or isinstance(r.exception, SystemExit), (name, r.exception)
        one_error_line(r)
        assert not (tmp_path / "o.h5").exists(), name


@pytest.mark.parametrize("body", ['alphas = "0.1"', 'steps = "100"', 'name = "a\\u0000b"', "methods = [1]",
                                  "epochs = 1.5", "centralized = 3", "max_train = -1"])
def test_toml_values_of_the_wrong_type_end_in_one_line(tmp_path, body):
    (tmp_path / "g.toml").write_text(body + "\n")
    one_error_line(cli("experiment", tmp_path / "g.toml", "--out-dir", tmp_path / "w"))


# ------------------------------------------------------------------ 6. messages


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


@pytest.mark.parametrize("value", ['"abc"', "true", "1e3", "0", "-5"])
def test_a_recapture_source_with_an_ill_typed_batch_size_ends_in_one_line(tmp_path, kron_artifact, small_silo, value):
    bad = tmp_path / "src.h5"
    bad.write_bytes(kron_artifact.read_bytes())
    with h5py.File(bad, "r+") as f:
        meta = json.loads(bytes(f.attrs["metadata"]).decode())
        meta["curvature_batch_size"] = json.loads(value)
        f.attrs["metadata"] = text_attr(json.dumps(meta))
    silo = tmp_path / "s.h5"
    write_silo(silo, small_silo)
    line = one_error_line(cli("recapture", "--artifact", bad, "--data", silo, "--structure", "diag", "--out", tmp_path / "o.h5"))
    assert "curvature_batch_size" in line or "curvature-batch-size" in line


def test_init_refuses_to_overwrite_its_transform_source(tmp_path, silo_file):
    before = silo_file.read_bytes()
    line = one_error_line(cli("init", "--model", "mlp", "--transform-from", silo_file, "--out", silo_file))
    assert "must differ" in line and silo_file.read_bytes() == before
