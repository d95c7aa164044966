"""Importing a user's data (`import-data`) from hostile or broken sources: fifos, compression and size bombs, label names, transforms that overflow; one line each."""

from __future__ import annotations

import gzip
import io
import os
import struct
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import child, cli, one_error_line


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
