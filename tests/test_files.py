"""Writing outputs safely: planted links, locks, temporaries, outputs that are inputs, atomic folders, unwritable paths, a full disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import cli, one_error_line

from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import (
    OutputError,
)
from posterior_fusion.files import atomic_folder, output_lock, write_atomically


def test_unwritable_outputs_fail_before_the_work_in_one_line(tmp_path, small_silo):
    write_silo(tmp_path / "s.h5", SiloData(small_silo.x[:40], small_silo.y[:40], "fmnist", 10))
    (tmp_path / "afile").write_text("x")
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "mlp",
                                   "--out", str(tmp_path / "afile" / "o.h5")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "cannot write" in r.stderr
    assert "component" not in r.stderr  # refused before training
    with output_lock(tmp_path / "o.h5"):
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "mlp",
                                       "--out", str(tmp_path / "o.h5")])
        assert r.exit_code == 2 and "another process is writing" in r.stderr


def test_disk_full_keeps_the_partial_fit_and_stale_temporaries_are_removed(tmp_path, small_silo, monkeypatch):
    from posterior_fusion.artifact import writer

    write_silo(tmp_path / "s.h5", SiloData(small_silo.x[:40], small_silo.y[:40], "fmnist", 10))
    stale = tmp_path / ".o.h5.tmp-999999999-x1y2"
    stale.write_bytes(b"junk")
    real = writer.atomic_h5_write

    def full_on_final(path, fill, check=None):
        if not str(path).endswith(".partial.h5"):
            raise OutputError(f"{path}: cannot write (no space left on the device)")
        return real(path, fill, check)

    monkeypatch.setattr(writer, "atomic_h5_write", full_on_final)
    args = ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "mlp", "-M", "2", "--epochs", "1",
            "--out", str(tmp_path / "o.h5")]
    r = CliRunner().invoke(pfuse, args)
    assert r.exit_code == 2 and "no space left" in r.stderr and "--resume" in r.stderr and r.stderr.count("error:") == 1
    assert (tmp_path / ".o.h5.partial.h5").exists() and not (tmp_path / "o.h5").exists()
    monkeypatch.setattr(writer, "atomic_h5_write", real)
    r = CliRunner().invoke(pfuse, [*args, "--resume"])
    assert r.exit_code == 0 and "resuming: 2 of 2" in r.stderr
    assert not stale.exists()  # removed by the next write to o.h5 (its pid is not running)


def test_os_errors_of_a_write_become_one_output_error(tmp_path, monkeypatch):
    from posterior_fusion import files as atomic

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.h5py, "File", no_space)
    with pytest.raises(OutputError, match="no space left on the device"):
        atomic.atomic_h5_write(tmp_path / "x.h5", lambda f: None)
    assert list(tmp_path.iterdir()) == []


SECRET = b"precious user data\n"


def _secret(tmp_path) -> Path:
    target = tmp_path / "elsewhere" / "victim.txt"
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(SECRET)
    return target


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


def test_init_refuses_to_overwrite_its_transform_source(tmp_path, silo_file):
    before = silo_file.read_bytes()
    line = one_error_line(cli("init", "--model", "mlp", "--transform-from", silo_file, "--out", silo_file))
    assert "must differ" in line and silo_file.read_bytes() == before
