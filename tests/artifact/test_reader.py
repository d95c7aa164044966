"""The artifact reader facing a hostile or broken file: storage outside the file, memory bombs, typed metadata, values past their declared bounds, links, fuzzed bytes; each refused in one line before any allocation it would cause."""

from __future__ import annotations

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
from conftest import (
    TINY_META,
    TINY_SPEC,
    child,
    cli,
    fit_artifact,
    kron_component,
    one_error_line,
)

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact, write_global_artifact
from posterior_fusion.artifact.writer import text_attr
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag, Diag, Kron
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.errors import (
    ArtifactError,
    DataError,
    OutputError,
    PfuseError,
    ResourceLimitError,
    SchemaError,
)
from posterior_fusion.fusion import fuse
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.posterior import Component, frozen_mapping

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


def test_curvature_beyond_the_declared_scale_is_refused_and_at_the_edge_fusion_stays_finite(tmp_path):
    """Each block's largest curvature eigenvalue (bounded by a trace, a product of traces or the largest
    diagonal entry) is at most ``CURVATURE_MAX``: a Kronecker block of two 1e20 factors or a diagonal of 1e30
    is refused by the writer's read-back and the reader in one line; clients at the edge (largest eigenvalue
    just under the bound) fuse with fedbens, fisher-merge and fedavg to finite weights or one error line."""
    from posterior_fusion.artifact.blocks import CURVATURE_MAX

    layout = ParameterLayout.from_model(TINY_SPEC.build())
    with pytest.raises(OutputError, match="curvature too large"):
        write_client_artifact(tmp_path / "k.h5", TINY_SPEC, layout, TINY_META, [kron_component(1e20 * torch.eye(3), 1e20 * torch.eye(6))])
    comp = Component(0, torch.zeros(layout.dim), BlockDiag([Diag(torch.full((layout.dim,), 1e30))]),
                     frozen_mapping({"seed": 0}), 1.0, 1.0)
    with pytest.raises(OutputError, match="curvature too large"):
        write_client_artifact(tmp_path / "d.h5", TINY_SPEC, layout, dict(TINY_META, structure="diag"), [comp])
    paths = []
    g = torch.Generator().manual_seed(0)
    for c in range(2):
        edge = (0.99 * CURVATURE_MAX / 18) ** 0.5  # tr(B)·tr(A) = 3·edge · 6·edge = 0.99 · CURVATURE_MAX
        B, A = edge * torch.eye(3), edge * torch.eye(6)
        comp = Component(0, torch.randn(layout.dim, generator=g), BlockDiag([Kron(B, A), Diag(torch.ones(3))]),
                         frozen_mapping({"seed": 0}), 1.0, 1.0)
        paths.append(tmp_path / f"edge_{c}.h5")
        write_client_artifact(paths[-1], TINY_SPEC, layout, TINY_META, [comp])
    runner = CliRunner()
    for method in ("fedbens", "fisher-merge", "fedavg"):
        out = tmp_path / f"g_{method}.h5"
        r = runner.invoke(pfuse, ["fuse", *map(str, paths), "--method", method, "--out", str(out)])
        if r.exit_code == 0:
            assert all(torch.isfinite(w).all() for w in posterior_fusion.load(out).members), method
        else:
            assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, (method, r.output)


def test_weights_beyond_the_declared_bound_and_featureless_imports_are_one_line(tmp_path):
    """A client artifact whose FedPPD student (or MAP) holds 3e38 — finite in float32, its average not — is
    refused by the reader (one line naming the dataset) before any fusion; ``import-data`` of inputs with no
    features, or with more features than a computed transform holds, names the file and the cause."""
    import h5py
    import numpy as np

    from posterior_fusion.artifact.reader import WEIGHT_MAX

    layout = ParameterLayout.from_model(TINY_SPEC.build())
    comp = kron_component(torch.eye(3), torch.eye(6))
    comp = Component(0, comp.map, comp.curvature, comp.training, 1.0, 1.0, student=torch.zeros(layout.dim))
    write_client_artifact(tmp_path / "c.h5", TINY_SPEC, layout, TINY_META, [comp])
    for name in ("ppd_student", "map"):
        bad = tmp_path / f"{name}.h5"
        bad.write_bytes((tmp_path / "c.h5").read_bytes())
        with h5py.File(bad, "r+") as f:
            f[f"components/0/{name}"][0] = 3e38
        r = CliRunner().invoke(pfuse, ["inspect", str(bad), "--validate"])
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and f"/components/0/{name}" in lines[0], r.output
        assert f"beyond {WEIGHT_MAX:g}" in lines[0]
    np.savez(tmp_path / "z.npz", x=np.zeros((10, 0), dtype=np.float32), y=np.zeros(10, dtype=np.int64))
    width = 100_001
    (tmp_path / "wide.csv").write_text(",".join(f"c{i}" for i in range(width)) + ",label\n"
                                       + ("," .join(["1"] * width) + ",0\n") * 2)
    for source, words in (("z.npz", "the inputs have no features"), ("wide.csv", "100,001 features")):
        r = CliRunner().invoke(pfuse, ["import-data", str(tmp_path / source), "--out", str(tmp_path / "d.h5")])
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and source in lines[0] and words in lines[0], r.output


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory, small_silo):
    path = tmp_path_factory.mktemp("fuzz") / "tiny.h5"
    silo = SiloData(small_silo.x[:64], small_silo.y[:64], "fmnist", 10)
    fit_artifact(path, silo, "kron", kwargs={"hidden": 4}, mixtures=2, swag=True)
    return path


def test_fuzz_byte_flips_and_truncations(tmp_path, tiny_artifact):
    """Seeded: 300 corrupted copies; each loads or raises an ArtifactError, nothing else."""
    raw = tiny_artifact.read_bytes()
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for case in range(300):
        data = bytearray(raw)
        if case % 2:
            data = data[: rng.randrange(0, len(raw))]
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        bad = tmp_path / "fuzz.h5"
        bad.write_bytes(bytes(data))
        try:
            posterior_fusion.load(bad)
            outcomes["ok"] += 1
        except ArtifactError as exc:
            assert str(exc).startswith(str(bad)), f"case {case}: message does not name the file: {exc}"
            outcomes["error"] += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case}: unexpected {type(exc).__name__}: {exc}")
    assert outcomes["error"] >= 150  # every truncation and most flips are detected


def test_global_artifact_refused_as_client(tmp_path, honest):
    _, paths = honest
    _, res, meta = fuse(paths, "fedavg")
    from posterior_fusion.artifact import write_global_artifact

    art = posterior_fusion.load(paths[0])
    write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, meta, res.members)
    shutil.copy(tmp_path / "g.h5", tmp_path / "g2.h5")
    with pytest.raises(ArtifactError, match="expected a client artifact"):
        fuse([paths[0], tmp_path / "g.h5"], "fedavg")
    with h5py.File(tmp_path / "g2.h5", "r") as f:
        assert f.attrs["artifact_kind"] == b"global"
