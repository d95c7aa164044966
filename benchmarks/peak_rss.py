"""Peak resident memory (VmHWM) of every pfuse command on its largest honest input here (full
Fashion-MNIST, LeNet) and on hostile inputs over a 256 MiB budget (docs/security.md).

    nice -n 19 .venv/bin/python benchmarks/peak_rss.py --work runs/rss [--json docs/results/security/peak_rss.json]

Each command runs in its own process; its peak is read from /proc/self/status at exit (getrusage
would include the size of the process that forked it).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import struct
import zipfile
from pathlib import Path

import numpy as np

from posterior_fusion.experiment.measure import run_measured


def run(*args: str | Path) -> dict:
    r = run_measured(*args)
    return {"command": " ".join(map(str, args)), **{k: r[k] for k in ("exit", "seconds", "peak_mib", "error")}}


def npy_header(shape) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buf.getvalue()


def hostile(work: Path) -> list[tuple[str, list]]:
    """Inputs that declare far more than the budget, in small files."""
    with zipfile.ZipFile(work / "bomb.npz", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", npy_header((200_000, 3, 100, 100)) + b"\0" * 10_000_000)
    (work / "big.npy").write_bytes(npy_header((100_000, 100_000)) + b"\0" * 64)
    with gzip.open(work / "bomb-idx3-ubyte.gz", "wb") as fh:
        fh.write(struct.pack(">HBB", 0, 8, 3) + struct.pack(">3I", 1_000_000, 64, 64) + b"\0" * 50_000_000)
    from PIL import Image

    (work / "imgs" / "a").mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, format="PNG")
    raw = bytearray(buf.getvalue())
    i = raw.index(b"IHDR")
    raw[i + 4 : i + 12] = struct.pack(">II", 60_000, 60_000)
    import zlib

    raw[i + 17 : i + 21] = struct.pack(">I", zlib.crc32(bytes(raw[i : i + 17])) & 0xFFFFFFFF)
    (work / "imgs" / "a" / "0.png").write_bytes(bytes(raw))
    from scipy.io import savemat

    savemat(work / "bomb.mat", {"X": np.zeros((32, 32, 3, 200_000), np.uint8), "y": np.ones((200_000, 1))},
            do_compression=True)
    budget = ["--max-memory", "256M"]
    (work / "huge.toml").write_text("alphas = [" + ", ".join(["0.1"] * 60) + "]\nseeds = [" +
                                    ", ".join(map(str, range(60))) + "]\nclients = [" + ", ".join(map(str, range(1, 61))) +
                                    "]\n")
    import h5py

    with h5py.File(work / "c0.h5") as src, h5py.File(work / "links.h5", "w") as f:
        for key, value in src.attrs.items():
            f.attrs[key] = value
        g = f.create_group("components")
        src.copy(src["components/0"], g, "0")
        g["0"].attrs["training"] = np.bytes_(json.dumps({"pad": "x" * 3_900_000}).encode())
        for k in range(1, 2000):
            g[str(k)] = g["0"]
    return [
        ("experiment 60x60x60 grid", ["experiment", work / "huge.toml", "--out-dir", work / "huge"]),
        ("inspect 2,000 links to a 3.9 MB attribute", ["inspect", work / "links.h5"]),
        ("fuse under 8M", ["fuse", work / "c0.h5", work / "c1.h5", "--method", "fedbens", "--out", work / "x.h5",
                           "--max-memory", "8M"]),
        ("predict, test file over 16M", ["predict", work / "g.h5", "--data", work / "split" / "test.h5",
                                         "--out", work / "x.h5", "--max-memory", "16M"]),
        ("recapture under 8M", ["recapture", "--artifact", work / "c0.h5", "--data", work / "split" / "client_0.h5",
                                "--structure", "diag", "--out", work / "x.h5", "--max-memory", "8M"]),
        ("import-data npz bomb", ["import-data", work / "bomb.npz", "--out", work / "o.h5", *budget]),
        ("import-data npy header", ["import-data", work / "big.npy", "--out", work / "o.h5", *budget]),
        ("import-data gzip IDX bomb", ["import-data", work / "bomb-idx3-ubyte.gz", "--format", "idx",
                                       "--out", work / "o.h5", *budget]),
        ("import-data 60000x60000 PNG", ["import-data", work / "imgs", "--out", work / "o.h5", *budget]),
        ("import-data .mat zlib bomb", ["import-data", work / "bomb.mat", "--out", work / "o.h5", *budget]),
        ("init model-kwargs bomb", ["init", "--model", "mlp", "--model-kwargs",
                                    '{"in_features": 784, "hidden_sizes": [40000, 40000]}', "--out", work / "i.h5",
                                    *budget]),
        ("fit-local model-kwargs bomb", ["fit-local", "--data", work / "split" / "client_0.h5", "--model", "mlp",
                                         "--model-kwargs", '{"in_features": 784, "hidden_sizes": [8000, 8000]}',
                                         "--out", work / "o.h5", *budget]),
        ("evaluate --bins 1e9", ["evaluate", work / "g.h5", "--data", work / "split" / "test.h5", "--bins",
                                 "1000000000"]),
        ("evaluate glm under 256M", ["evaluate", work / "g.h5", "--data", work / "split" / "test.h5",
                                     "--predictive", "glm", *budget]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", type=Path, default=Path("runs/pfuse-rss"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cases", default="", help="Only the cases whose label contains this text [default: all].")
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    split = work / "split"
    honest = [
        ("import-data (Fashion-MNIST train, 60,000 images)", ["import-data", "/usr/share/datasets/fashion-mnist/"
                                                              "train-images-idx3-ubyte.gz", "--labels",
                                                              "/usr/share/datasets/fashion-mnist/"
                                                              "train-labels-idx1-ubyte.gz", "--out", work / "fm.h5"]),
        ("partition (full Fashion-MNIST, 3 clients)", ["partition", "--clients", "3", "--alpha", "0.5",
                                                        "--out-dir", split]),
        ("init (lenet, M = 2)", ["init", "--model", "lenet", "-M", "2", "--out", work / "init.h5"]),
        ("fit-local (lenet, largest silo, M = 2, 2 epochs, kron)", ["fit-local", "--data", split / "client_0.h5",
                                                                    "--init", work / "init.h5", "--epochs", "2",
                                                                    "--out", work / "c0.h5"]),
        ("fit-local (client 1)", ["fit-local", "--data", split / "client_1.h5", "--init", work / "init.h5",
                                  "--epochs", "2", "--out", work / "c1.h5"]),
        ("fit-local (client 2)", ["fit-local", "--data", split / "client_2.h5", "--init", work / "init.h5",
                                  "--epochs", "2", "--out", work / "c2.h5"]),
        ("recapture (diag)", ["recapture", "--artifact", work / "c0.h5", "--data", split / "client_0.h5",
                              "--structure", "diag", "--out", work / "c0d.h5"]),
        ("fuse (fedbens, 3 clients, 100 steps, --val)", ["fuse", work / "c0.h5", work / "c1.h5", work / "c2.h5",
                                                         "--method", "fedbens", "--set", "steps=100", "--val",
                                                         split / "server_val.h5", "--out", work / "g.h5"]),
        ("inspect", ["inspect", work / "c0.h5", "--validate"]),
        ("predict (map, 10,000 test images)", ["predict", work / "g.h5", "--data", split / "test.h5",
                                               "--out", work / "p.h5"]),
        ("evaluate (map)", ["evaluate", work / "g.h5", "--data", split / "test.h5"]),
        ("evaluate (glm, 10,000 test images, --max-memory 1G)", ["evaluate", work / "g.h5", "--data",
                                                                 split / "test.h5", "--predictive", "glm",
                                                                 "--max-memory", "1G"]),
        ("evaluate (glm, PFUSE_MALLOC=default)", ["evaluate", work / "g.h5", "--data", split / "test.h5",
                                                  "--predictive", "glm", "--max-memory", "1G"]),
        ("experiment (tests/smoke.toml: 8 fits, 32 fusions)", ["experiment", "tests/smoke.toml",
                                                                    "--out-dir", work / "smoke"]),
    ]
    rows = []
    for label, cmd in honest:
        if args.cases not in label:
            continue
        env_default = "PFUSE_MALLOC=default" in label
        if env_default:
            os.environ["PFUSE_MALLOC"] = "default"
        row = dict(run(*cmd), case=label, kind="honest")
        os.environ.pop("PFUSE_MALLOC", None)
        print(json.dumps(row), flush=True)
        rows.append(row)
    for label, cmd in hostile(work):
        if args.cases not in label:
            continue
        row = dict(run(*cmd), case=label, kind="over budget")
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:  # rows of cases run again replace their earlier rows
        args.json.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(args.json.read_text())["rows"] if args.json.exists() else []
        done = {r["case"] for r in rows}
        rows = [r for r in old if r["case"] not in done] + rows
        args.json.write_text(json.dumps({"threads": os.environ.get("OMP_NUM_THREADS", "default"), "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
