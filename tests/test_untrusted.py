"""Second security pass: files that make the server read elsewhere, memory bombs, hostile
metadata and data files, Flower replies, robust screening that holds, safe outputs."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import fit_artifact, fit_split

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact, write_global_artifact
from posterior_fusion.artifact.writer import text_attr
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron
from posterior_fusion.data.silo import SiloData, read_silo, write_silo
from posterior_fusion.errors import (
    ArtifactError,
    DataError,
    FederationError,
    ModelSpecError,
    OutputError,
    PfuseError,
    ResourceLimitError,
    SchemaError,
)
from posterior_fusion.files import output_lock
from posterior_fusion.flower.server_app import Reply, collect_replies, reply_from_message
from posterior_fusion.fusion.robust import screen_clients
from posterior_fusion.posterior import Component

PATTERN = b"TOP-SECRET-PATTERN-" * 64


def run_cli_subprocess(*args, timeout=60):
    """The real CLI in a child process: a hang fails the test instead of blocking the suite."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", "from posterior_fusion.cli.main import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.time() - t0


def replace_map(src, dst, make):
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        n = f["/components/0/map"].shape[0]
        del f["/components/0/map"]
        make(f["/components/0"], n)
    return dst


# ------------------------------------------------------------------ storage outside the file


def test_external_raw_storage_is_refused_and_the_bytes_never_leak(tmp_path, kron_artifact):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(PATTERN * 100)
    bad = replace_map(kron_artifact, tmp_path / "ext.h5",
                      lambda g, n: g.create_dataset("map", shape=(n,), dtype="f4", external=[(str(secret), 0, 4 * n)]))
    with pytest.raises(SchemaError, match="external raw storage"):
        posterior_fusion.load(bad)
    out = tmp_path / "g.h5"
    r = CliRunner().invoke(pfuse, ["fuse", str(bad), str(kron_artifact), "--method", "fedavg", "--out", str(out)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "external raw storage" in r.stderr
    assert not out.exists() and b"TOP-SECRET" not in (r.stdout + r.stderr).encode()


def test_virtual_dataset_onto_another_file_is_refused(tmp_path, kron_artifact):
    other = tmp_path / "other.h5"
    shutil.copy(kron_artifact, other)

    def make(g, n):
        layout = h5py.VirtualLayout(shape=(n,), dtype="f4")
        layout[:] = h5py.VirtualSource(str(other), "/components/1/map", shape=(n,))
        g.create_virtual_dataset("map", layout)

    bad = replace_map(kron_artifact, tmp_path / "vds.h5", make)
    with pytest.raises(SchemaError, match="virtual dataset"):
        posterior_fusion.load(bad)


def test_fifo_target_is_refused_without_hanging(tmp_path, kron_artifact):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    bad = replace_map(kron_artifact, tmp_path / "fifo.h5",
                      lambda g, n: g.create_dataset("map", shape=(n,), dtype="f4", external=[(str(fifo), 0, 4 * n)]))
    proc, seconds = run_cli_subprocess("inspect", str(bad), "--validate")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "external raw storage" in proc.stderr
    assert seconds < 60


def test_unknown_filter_and_unallocated_data_are_refused(tmp_path, kron_artifact):
    bad = replace_map(kron_artifact, tmp_path / "lzf.h5",
                      lambda g, n: g.create_dataset("map", data=np.zeros(n, np.float32), compression="lzf"))
    with pytest.raises(SchemaError, match="filter"):
        posterior_fusion.load(bad)
    bad = replace_map(kron_artifact, tmp_path / "holes.h5",
                      lambda g, n: g.create_dataset("map", shape=(n,), dtype="f4", chunks=(64,)))
    with pytest.raises(SchemaError, match="unallocated"):
        posterior_fusion.load(bad)


def test_big_endian_floats_load_with_the_same_values(tmp_path, kron_artifact):
    ref = posterior_fusion.load(kron_artifact)
    be = replace_map(kron_artifact, tmp_path / "be.h5",
                     lambda g, n: g.create_dataset("map", data=ref.components[0].map.numpy().astype(">f4")))
    torch.testing.assert_close(posterior_fusion.load(be).components[0].map, ref.components[0].map)


# ------------------------------------------------------------------ memory bombs


def data_bomb(path, rows=10**7, compressed=False):
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "posterior-fusion-data"
        f.attrs["format_version"] = 1
        f.attrs["num_classes"] = 10
        if compressed:
            f.create_dataset("x", data=np.zeros((rows, 28, 28), np.uint8), compression="gzip", compression_opts=9,
                             chunks=(4096, 28, 28))
        else:
            f.create_dataset("x", shape=(rows, 28, 28), dtype="u1", chunks=(1024, 28, 28))
        f.create_dataset("y", shape=(rows,), dtype="i8", chunks=(min(rows, 1 << 16),))
    return path


def test_tiny_files_declaring_huge_data_are_refused_before_allocation(tmp_path, kron_artifact):
    bomb = data_bomb(tmp_path / "bomb.h5")
    assert bomb.stat().st_size < 100_000
    with pytest.raises(DataError, match="unallocated"):
        read_silo(bomb)
    gz = data_bomb(tmp_path / "gz.h5", rows=40_000, compressed=True)
    with pytest.raises(DataError, match="compression ratio"):
        read_silo(gz)
    for cmd in (["evaluate", str(tmp_path / "g.h5"), "--data", str(bomb)], ["fit-local", "--data", str(bomb),
                                                                              "--out", str(tmp_path / "o.h5")]):
        if cmd[0] == "evaluate":
            write_global_artifact(tmp_path / "g.h5", posterior_fusion.load(kron_artifact).model_spec,
                                  posterior_fusion.load(kron_artifact).layout, {"method": "x"},
                                  [posterior_fusion.load(kron_artifact).components[0].map])
        proc, seconds = run_cli_subprocess(*cmd)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and str(bomb) in proc.stderr, proc.stderr


def test_memory_budget_applies_to_every_reader(tmp_path, kron_artifact, small_silo):
    with pytest.raises(ResourceLimitError, match="loading"):
        posterior_fusion.load(kron_artifact, max_memory=1000)
    write_silo(tmp_path / "s.h5", small_silo)
    with pytest.raises(ResourceLimitError, match="reading"):
        read_silo(tmp_path / "s.h5", max_memory="10K")
    for args in (["inspect", str(kron_artifact), "--validate"], ["fit-local", "--data", str(tmp_path / "s.h5"), "--out",
                                                   str(tmp_path / "o.h5")]):
        r = CliRunner().invoke(pfuse, [*args, "--max-memory", "1K"])
        assert r.exit_code == 2 and "over the limit" in r.stderr and r.stderr.count("\n") == 1
    r = CliRunner().invoke(pfuse, ["fuse", str(kron_artifact), "--method", "fedbe", "--set", "num_samples=1000000",
                                   "--out", str(tmp_path / "g.h5"), "--max-memory", "1G"])
    assert r.exit_code == 2 and "fedbe" in r.stderr and "over the limit" in r.stderr


# ------------------------------------------------------------------ metadata


def edit_meta(src, dst, change):
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        meta = json.loads(bytes(f.attrs["metadata"]).decode())
        text = change(meta)
        f.attrs["metadata"] = text_attr(text if isinstance(text, str) else json.dumps(meta))
    return dst


META_CASES = {
    "infinite_T": (lambda m: json.dumps(m).replace('"temperature": 0.1', '"temperature": Infinity'), "Infinity"),
    "denormal_T": (lambda m: m.update(temperature=1e-320), "temperature"),
    "huge_n": (lambda m: json.dumps(m).replace(f'"n_data": {m["n_data"]}', '"n_data": 1' + "0" * 400), "digits"),
    "n_over_cap": (lambda m: m.update(n_data=10**12), "n_data"),
    "nan_prior": (lambda m: json.dumps(m).replace('"prior_precision": 10.0', '"prior_precision": NaN'), "NaN"),
    "counts_mismatch": (lambda m: m.update(class_counts=[1] * 10), "class_counts"),
    "deep_json": (lambda m: json.dumps(m)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}", "nested"),
    "bool_n": (lambda m: m.update(n_data=True), "n_data"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_metadata_is_typed_and_range_checked(tmp_path, kron_artifact, case):
    change, needle = META_CASES[case]
    bad = edit_meta(kron_artifact, tmp_path / f"{case}.h5", change)
    with pytest.raises(SchemaError, match=needle) as info:
        posterior_fusion.load(bad)
    assert str(info.value).startswith(str(bad)) and "[/]" in str(info.value)
    r = CliRunner().invoke(pfuse, ["inspect", str(bad), "--validate"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1


def test_training_record_of_the_wrong_type_is_refused(tmp_path, kron_artifact):
    bad = tmp_path / "train.h5"
    shutil.copy(kron_artifact, bad)
    with h5py.File(bad, "r+") as f:
        f["/components/0"].attrs["training"] = text_attr(json.dumps({"final_loss": "low"}))
    r = CliRunner().invoke(pfuse, ["inspect", str(bad), "--validate"])
    assert r.exit_code == 2 and "final_loss" in r.stderr and "/components/0" in r.stderr


# ------------------------------------------------------------------ data files


def data_file(path, x, y, attrs=None):
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "posterior-fusion-data"
        f.attrs["format_version"] = 1
        f.attrs["num_classes"] = 10
        for k, v in (attrs or {}).items():
            f.attrs[k] = v
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=y)
    return path


DATA_CASES = {
    "array_attr": (lambda p: data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64),
                                       {"num_classes": np.arange(3)}), "scalar"),
    "rank_5": (lambda p: data_file(p, np.zeros((4, 1, 1, 28, 28), np.uint8), np.zeros(4, np.int64)), "rank"),
    "empty": (lambda p: data_file(p, np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.int64)), "empty"),
    "labels_int32": (lambda p: data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int32)), "int64"),
    "extra_object": (lambda p: (data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64)),
                                h5py.File(p, "a").create_dataset("z", data=[1]).file.close())[0], "/z"),
    "soft_link": (lambda p: (data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64)),
                             _soft_x(p))[0], "not allowed"),
    "string_format": (lambda p: data_file(p, np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64),
                                          {"format_version": "1"}), "integer"),
}


def _soft_x(p):
    with h5py.File(p, "a") as f:
        f["y2"] = f["y"][()]
        del f["y"]
        f["y"] = h5py.SoftLink("/y2")


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_hostile_data_files_one_line_each(tmp_path, case):
    make, needle = DATA_CASES[case]
    path = make(tmp_path / f"{case}.h5")
    with pytest.raises(DataError, match=needle) as info:
        read_silo(path)
    assert str(info.value).startswith(str(path))
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(path), "--model", "mlp", "--out", str(tmp_path / "o.h5")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "o.h5").exists()


def test_data_that_does_not_fit_the_model_is_one_line(tmp_path, kron_artifact, small_silo):
    art = posterior_fusion.load(kron_artifact)  # mlp with 784 inputs
    write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"method": "x"}, [art.components[0].map])
    data_file(tmp_path / "wide.h5", np.zeros((5, 40, 40), np.uint8), np.zeros(5, np.int64))
    for cmd in (["evaluate", str(tmp_path / "g.h5"), "--data", str(tmp_path / "wide.h5")],
                ["predict", str(tmp_path / "g.h5"), "--data", str(tmp_path / "wide.h5"), "--out", str(tmp_path / "p.h5")],
                ["fit-local", "--data", str(tmp_path / "wide.h5"), "--model", "lenet", "--out", str(tmp_path / "o.h5")]):
        r = CliRunner().invoke(pfuse, cmd)
        assert r.exit_code == 2 and "do not fit model" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    with pytest.raises(ModelSpecError):
        art.model_spec.check_input((3, 32, 32), "x")


# ------------------------------------------------------------------ Flower replies


class FakeMessage:
    def __init__(self, node, content=None, error=None):
        from flwr.app import RecordDict

        self.metadata = type("Meta", (), {"src_node_id": node})()
        self.content = content if content is not None else RecordDict({})
        self.error = type("Err", (), {"reason": error})() if error else None

    def has_error(self):
        return self.error is not None


def test_flower_replies_are_typed_checked_and_named_by_the_server(tmp_path, kron_artifact):
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from posterior_fusion.flower.transfer import file_fields, message_content

    good = kron_artifact.read_bytes()

    def reply(fields: dict, files: dict | None = None, array=None) -> RecordDict:
        content = message_content("artifact", fields, {"artifact": good} if files is None else files)
        if array is not None:  # the file's bytes replaced by another array, its announced SHA-256 and length kept
            content.array_records["files"] = ArrayRecord({"artifact": Array(array)})
        return content

    changed = bytearray(good)
    changed[len(good) // 2] ^= 1
    msgs = [FakeMessage(11, reply({"partition-id": 0})),
            FakeMessage(12, reply({"partition-id": 0})),          # colliding id: still its own file
            FakeMessage(13, reply({"partition-id": "x"}, array=np.frombuffer(good, np.uint8).astype(np.float32))),
            FakeMessage(14, reply({"partition-id": 1e300})),
            FakeMessage(15, None),
            FakeMessage(16, error="boom"),
            FakeMessage(17, reply({}, array=np.frombuffer(bytes(changed), np.uint8))),  # a chunk changed
            FakeMessage(18, RecordDict({"artifact": ConfigRecord(file_fields("artifact", good))})),  # bytes lost
            FakeMessage(19, reply({}, files={}))]
    replies = [reply_from_message(k, m) for k, m in enumerate(msgs)]
    assert [r.reported_partition_id for r in replies[:4]] == [0, 0, None, None]
    logs = []
    paths = collect_replies(replies, tmp_path / "out", "skip", logs.append)
    assert [p.name for p in paths] == ["client_0.h5", "client_1.h5", "client_3.h5"]
    assert (tmp_path / "out" / "client_0.h5").read_bytes() == good
    assert any("client 2: reply rejected (file 'artifact' must be" in m and "as a uint8 array" in m for m in logs)
    assert any("client 4: reply rejected (reply has no valid 'artifact' record" in m for m in logs)
    assert any("client 6: reply rejected (file 'artifact' is not the bytes its SHA-256 names" in m for m in logs)
    assert any("client 7: reply rejected (file 'artifact' is announced" in m and "missing" in m for m in logs)
    assert any("client 8: reply rejected (reply carries no file 'artifact')" in m for m in logs)
    small = reply_from_message(0, msgs[0], max_memory=3 * len(good) - 3)
    assert small.blob is None and "more than the" in small.error
    with pytest.raises(FederationError, match="distinct"):
        collect_replies([Reply(0, good), Reply(0, good)], tmp_path / "dup", "skip", logs.append)
    # second names after the reported partition: only an id claimed by exactly one accepted node
    from posterior_fusion.flower.server_app import name_by_silo

    out = tmp_path / "out"
    (out / "silo_7.h5").symlink_to(tmp_path / "elsewhere.h5")  # an earlier round's name: replaced, not followed
    replies[3].reported_partition_id = 7
    named = name_by_silo(replies, paths, out, logs.append)
    assert named == {"client_3.h5": "silo_7.h5"} and not (out / "silo_0.h5").exists()
    assert any("all report partition id 0: no silo_0.h5" in m for m in logs)
    assert not (out / "silo_7.h5").is_symlink() and (out / "silo_7.h5").samefile(out / "client_3.h5")
    assert not (tmp_path / "elsewhere.h5").exists()


def test_flower_reply_over_the_memory_budget_is_skipped(tmp_path, kron_artifact):
    good = kron_artifact.read_bytes()
    logs = []
    with pytest.raises(FederationError, match="no valid"):
        collect_replies([Reply(0, good)], tmp_path / "cap", "skip", logs.append, max_memory=1000)
    assert any("over the limit" in m for m in logs)


# ------------------------------------------------------------------ robust screening


def attacked(src, dst, scale=1.0, flip=False, meta=None):
    art = posterior_fusion.load(src)
    comps = []
    for c in art.components:
        blocks = [Kron(b.B * scale, b.A) if isinstance(b, Kron) else Dense(b.G * scale) if isinstance(b, Dense)
                  else Diag(b.g * scale) for b in c.curvature.blocks]
        comps.append(Component(c.index, -c.map if flip else c.map, BlockDiag(blocks), dict(c.training),
                               c.temperature, c.prior_precision))
    write_client_artifact(dst, art.model_spec, art.layout, dict(art.metadata, **(meta or {})), comps)
    return dst


@pytest.fixture(scope="module")
def screening_clients(tmp_path_factory, fmnist_train):
    x, y = fmnist_train
    folder = tmp_path_factory.mktemp("screen")
    silo = SiloData(x[:1000], y[:1000], "fmnist", 10)
    honest = fit_split(folder, silo, 5, 200, "kron", name="honest", mixtures=2, epochs=3)
    flipped = SiloData(x[1000:1200], (9 - y[1000:1200]).astype(np.int64), "fmnist", 10)
    fit_artifact(folder / "labelflip.h5", flipped, "kron", mixtures=2, epochs=3, seed=9)
    val = SiloData(x[2000:2500], y[2000:2500], "fmnist", 10)
    return folder, honest, val


ATTACKS = {
    "curvature_x10": lambda src, dst, n: attacked(src, dst, scale=10.0),
    "curvature_x100": lambda src, dst, n: attacked(src, dst, scale=100.0),
    "tiny_T": lambda src, dst, n: attacked(src, dst, meta={"temperature": 1e-4}),
    "huge_n_data": lambda src, dst, n: attacked(src, dst, meta={"n_data": n * 10**5,
                                                                 "class_counts": [n * 10**5] + [0] * 9}),
    "sign_flip": lambda src, dst, n: attacked(src, dst, flip=True),
    "duplicate_one_byte": lambda src, dst, n: attacked(src, dst, meta={"note": "resubmitted"}),
}


@pytest.mark.parametrize("C", [3, 5])
@pytest.mark.parametrize("attack", sorted(ATTACKS) + ["label_flip"])
def test_screening_excludes_each_attacker_and_no_honest_client(tmp_path, screening_clients, attack, C):
    folder, honest, val = screening_clients
    others = honest[: C - 1]
    if attack == "label_flip":
        bad = folder / "labelflip.h5"
    else:  # a duplicate copies a participating client; the other attacks start from a client left out
        src = honest[0] if attack == "duplicate_one_byte" else honest[4]
        bad = ATTACKS[attack](src, tmp_path / f"{attack}.h5", posterior_fusion.load(src).n_data)
    clients = [posterior_fusion.load(p) for p in [*others, bad]]
    kept, rows = screen_clients(clients, val=val)
    assert [r["excluded"] for r in rows] == [False] * (C - 1) + [True], rows
    assert {c.path for c in kept} == {str(p) for p in others}


def test_screening_keeps_all_honest_clients(screening_clients):
    _, honest, val = screening_clients
    for C in (3, 5):
        kept, rows = screen_clients([posterior_fusion.load(p) for p in honest[:C]], val=val)
        assert len(kept) == C, rows


# ------------------------------------------------------------------ outputs


def test_large_metadata_is_written_and_read(tmp_path, kron_artifact):
    art = posterior_fusion.load(kron_artifact)
    history = [[{"step": i, "objective": float(i), "val_accuracy": 0.5} for i in range(3000)]]
    write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"method": "x", "history": history},
                          [art.components[0].map])
    assert len(posterior_fusion.load(tmp_path / "g.h5").metadata["history"][0]) == 3000


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


# ------------------------------------------------------------------ fuzz over the new constructions


def test_fuzz_hostile_constructions(tmp_path, kron_artifact):
    """Seeded and bounded: random hostile edits; only typed PfuseErrors, no traceback, no hang."""
    rng = random.Random(7)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(PATTERN * 100)
    n_params = posterior_fusion.load(kron_artifact).layout.dim

    def external(g, path, name, shape):
        g.create_dataset(name, shape=shape, dtype="f4", external=[(str(secret), rng.randrange(0, 64), 4 * int(np.prod(shape)))])

    def unallocated(g, path, name, shape):
        g.create_dataset(name, shape=shape, dtype="f4", chunks=tuple(max(1, s // 2) for s in shape))

    def wrong_endian(g, path, name, shape):
        g.create_dataset(name, data=np.ones(shape, ">f8"))

    def huge_shape(g, path, name, shape):
        g.create_dataset(name, shape=tuple(s * 1000 for s in shape), dtype="f4", chunks=True)

    def attr_junk(g, path, name, shape):
        g.create_dataset(name, data=np.zeros(shape, np.float32))
        g.file.attrs["metadata"] = text_attr(rng.choice(['{"n_data": 1e999}', "[" * 100 + "]" * 100, '{"a": NaN}', "{}"]))

    edits = [external, unallocated, wrong_endian, huge_shape, attr_junk]
    targets = ["/components/0/map", "/components/1/curvature/0/kron_B", "/components/0/curvature/1/dense"]
    counts = {"ok": 0, "refused": 0}
    t0 = time.time()
    for case in range(60):
        bad = tmp_path / f"f{case}.h5"
        shutil.copy(kron_artifact, bad)
        target = rng.choice(targets)
        with h5py.File(bad, "r+") as f:
            shape = f[target].shape
            group, name = f[target].parent, target.rsplit("/", 1)[1]
            del f[target]
            rng.choice(edits)(group, bad, name, shape)
        try:
            art = posterior_fusion.load(bad)
            counts["ok"] += 1
            assert art.layout.dim == n_params
        except PfuseError as exc:
            assert isinstance(exc, (ArtifactError, ResourceLimitError)) and "TOP-SECRET" not in str(exc)
            counts["refused"] += 1
    assert counts["refused"] >= 40 and time.time() - t0 < 120, counts
