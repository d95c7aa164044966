"""Own silos and own models: importers against files in their real formats, the shared input
transform, label-skew partitions, prediction-only files, entry-point model plugins, and the
shared-starting-point checks."""

from __future__ import annotations

import gzip
import json
import struct
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import install_fake_plugin

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.importers import load_source
from posterior_fusion.data.partition import label_skew_partition
from posterior_fusion.data.silo import read_silo, write_silo
from posterior_fusion.data.transform import CONSTANTS, InputTransform
from posterior_fusion.errors import DataError, ModelSpecError
from posterior_fusion.models import ModelSpec

RNG = np.random.default_rng(0)


def cli(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


def test_cifar10_binary_records(tmp_path):
    x = RNG.integers(0, 256, (7, 3, 32, 32), dtype=np.uint8)
    y = RNG.integers(0, 10, 7).astype(np.uint8)
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    for name, sl in (("data_batch_1.bin", slice(0, 4)), ("data_batch_2.bin", slice(4, 7))):
        np.concatenate([y[sl, None], x[sl].reshape(-1, 3072)], axis=1).tofile(folder / name)
    r = cli("import-data", folder, "--transform", "constants:cifar10", "--out", tmp_path / "c.h5")
    assert r.exit_code == 0, r.stderr
    d = read_silo(tmp_path / "c.h5")
    np.testing.assert_array_equal(d.x, x)
    np.testing.assert_array_equal(d.y, y.astype(np.int64))
    assert d.transform.mean == CONSTANTS["cifar10"][0] and d.transform.scale == pytest.approx(1 / 255)
    expected = (x[:, 1].astype(np.float32) / 255 - CONSTANTS["cifar10"][0][1]) / CONSTANTS["cifar10"][1][1]
    np.testing.assert_allclose(d.inputs()[:, 1].numpy(), expected, rtol=1e-6, atol=1e-6)
    (folder / "junk_batch.bin").write_bytes(b"\x01" * 100)
    with pytest.raises(DataError, match="3073"):
        load_source(str(folder), "cifar10")


def test_svhn_mat(tmp_path):
    from scipy.io import savemat

    x = RNG.integers(0, 256, (32, 32, 3, 5), dtype=np.uint8)
    y = np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)
    savemat(tmp_path / "train_32x32.mat", {"X": x, "y": y})
    r = cli("import-data", tmp_path / "train_32x32.mat", "--transform", "constants:svhn", "--out", tmp_path / "s.h5")
    assert r.exit_code == 0, r.stderr
    d = read_silo(tmp_path / "s.h5")
    np.testing.assert_array_equal(d.x, x.transpose(3, 2, 0, 1))
    np.testing.assert_array_equal(d.y, [0, 1, 2, 0, 9])


def test_image_folder_csv_npz_hdf5_and_idx(tmp_path):
    from PIL import Image

    imgs = {}
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(3):
            arr = RNG.integers(0, 256, (6, 5, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / "imgs" / cls / f"{i}.png")
            imgs[(cls, i)] = arr
    x, y = load_source(str(tmp_path / "imgs"))
    assert x.shape == (6, 3, 6, 5) and x.dtype == np.uint8 and y.tolist() == [0, 0, 0, 1, 1, 1]
    np.testing.assert_array_equal(x[4], imgs[("dog", 1)].transpose(2, 0, 1))

    (tmp_path / "t.csv").write_text("a,b,label\n1.5,2,yes\n3,-4.25,no\n0,1,yes\n")
    r = cli("import-data", tmp_path / "t.csv", "--out", tmp_path / "t.h5", "--json")
    assert r.exit_code == 0, r.stderr
    d = read_silo(tmp_path / "t.h5")
    np.testing.assert_array_equal(d.x, np.array([[1.5, 2], [3, -4.25], [0, 1]], np.float32))
    assert d.y.tolist() == [1, 0, 1]  # sorted class names: no=0, yes=1
    # auto transform: per-feature mean and std of the data, exactly
    np.testing.assert_allclose(d.transform.mean, d.x.mean(0), rtol=1e-6)
    np.testing.assert_allclose(d.transform.std, d.x.std(0), rtol=1e-6)
    np.testing.assert_allclose(d.inputs().numpy(), (d.x - d.x.mean(0)) / d.x.std(0), rtol=1e-5, atol=1e-6)

    xa, ya = RNG.normal(size=(9, 4)).astype(np.float64), RNG.integers(0, 3, 9)
    np.savez(tmp_path / "a.npz", x=xa, y=ya)
    xb, yb = load_source(str(tmp_path / "a.npz"))
    np.testing.assert_array_equal(xb, xa.astype(np.float32))
    np.testing.assert_array_equal(yb, ya)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object))
    with pytest.raises(DataError, match="cannot read"):
        load_source(str(tmp_path / "obj.npy"))  # never unpickled

    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["x"] = RNG.integers(0, 256, (4, 8, 8), dtype=np.uint8)
        f["y"] = np.arange(4)
    xh, yh = load_source(str(tmp_path / "plain.h5"))
    assert xh.shape == (4, 8, 8) and yh.tolist() == [0, 1, 2, 3]

    images = RNG.integers(0, 256, (3, 28, 28), dtype=np.uint8)
    with gzip.open(tmp_path / "k-images-idx3-ubyte.gz", "wb") as fh:
        fh.write(struct.pack(">HBB3I", 0, 8, 3, 3, 28, 28) + images.tobytes())
    with gzip.open(tmp_path / "k-labels-idx1-ubyte.gz", "wb") as fh:
        fh.write(struct.pack(">HBBI", 0, 8, 1, 3) + bytes([4, 0, 9]))
    r = cli("import-data", tmp_path / "k-images-idx3-ubyte.gz", "--labels", tmp_path / "k-labels-idx1-ubyte.gz",
            "--transform", "constants:mnist", "--out", tmp_path / "k.h5")
    assert r.exit_code == 0, r.stderr
    d = read_silo(tmp_path / "k.h5")
    np.testing.assert_array_equal(d.x, images)
    assert d.y.tolist() == [4, 0, 9] and d.transform.mean == (0.1307,)


def test_label_skew_partition_is_complete_disjoint_and_k_classes():
    labels = np.repeat(np.arange(10), 30)
    parts = label_skew_partition(labels, 5, 2, seed=3)
    allidx = np.concatenate(parts)
    assert sorted(allidx.tolist()) == list(range(300))
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits")
    assert cli("import-data", "sklearn:digits", "--out", folder / "digits.h5").exit_code == 0
    r = cli("partition", "--data", folder / "digits.h5", "--clients", 3, "--alpha", 0.5, "--val-size", 150,
            "--test-size", 300, "--out-dir", folder / "part", "--json")
    assert r.exit_code == 0, r.stderr
    return folder


def test_transform_travels_and_mismatches_are_one_line(tmp_path, digits):
    part = digits / "part"
    t0 = read_silo(part / "client_0.h5").transform
    assert t0 == read_silo(digits / "digits.h5").transform == read_silo(part / "test.h5").transform
    assert cli("init", "--model", "mlp", "--model-kwargs", '{"in_features": 64, "hidden": 16}', "-M", 2,
               "--transform-from", part / "client_0.h5", "--out", tmp_path / "init.h5").exit_code == 0
    for c in range(3):
        r = cli("fit-local", "--data", part / f"client_{c}.h5", "--init", tmp_path / "init.h5", "--structure", "kron",
                "--epochs", 2, "--train-seed", c, "--out", tmp_path / f"post_{c}.h5")
        assert r.exit_code == 0, r.stderr
    art = posterior_fusion.load(tmp_path / "post_0.h5")
    assert InputTransform.from_dict(art.metadata["input_transform"]).key() == t0.key()
    r = cli("fuse", *[tmp_path / f"post_{c}.h5" for c in range(3)], "--method", "fedbens", "--val", part / "server_val.h5",
            "--set", "steps=20", "--out", tmp_path / "g.h5")
    assert r.exit_code == 0, r.stderr
    assert cli("evaluate", tmp_path / "g.h5", "--data", part / "test.h5").exit_code == 0
    # the same test images imported with another transform are refused in one line
    other = read_silo(part / "test.h5")
    write_silo(tmp_path / "other.h5", other.__class__(other.x, other.y, "digits", 10,
                                                      transform=InputTransform(1 / 255, (0.5,), (0.25,))))
    r = cli("evaluate", tmp_path / "g.h5", "--data", tmp_path / "other.h5")
    assert r.exit_code == 2 and "input transform" in r.stderr and r.stderr.count("\n") == 1
    # a silo whose transform differs from the init file's is refused by fit-local
    r = cli("fit-local", "--data", tmp_path / "other.h5", "--init", tmp_path / "init.h5", "--out", tmp_path / "x.h5")
    assert r.exit_code == 2 and "input transform" in r.stderr
    # prediction on a file without labels
    with h5py.File(tmp_path / "other.h5", "a") as f:
        del f["y"]
    unlabeled = read_silo(tmp_path / "other.h5", labels=False)
    write_silo(tmp_path / "nolabels.h5", unlabeled.__class__(unlabeled.x, None, "digits", 10, transform=t0))
    r = cli("predict", tmp_path / "g.h5", "--data", tmp_path / "nolabels.h5", "--out", tmp_path / "p.h5")
    assert r.exit_code == 0, r.stderr
    with h5py.File(tmp_path / "p.h5") as f:
        assert f["probs"].shape == (300, 10)
    r = cli("evaluate", tmp_path / "g.h5", "--data", tmp_path / "nolabels.h5")
    assert r.exit_code == 2 and "labels" in r.stderr


def test_shared_starting_points_are_checked(tmp_path, digits):
    part = digits / "part"
    kw = ["--model", "mlp", "--model-kwargs", '{"in_features": 64, "hidden": 8}', "-M", 2, "--epochs", 1,
          "--structure", "diag"]
    for c, seed in enumerate((0, 1)):
        assert cli("fit-local", "--data", part / f"client_{c}.h5", *kw, "--init-seed", seed,
                   "--out", tmp_path / f"p{c}.h5").exit_code == 0
    r = cli("fuse", tmp_path / "p0.h5", tmp_path / "p1.h5", "--method", "fedbens", "--out", tmp_path / "g.h5")
    assert r.exit_code == 2 and "other starting points" in r.stderr and "p1.h5" in r.stderr
    r = cli("fuse", tmp_path / "p0.h5", tmp_path / "p1.h5", "--method", "fedbens", "--set", "allow_different_inits=true", "--set", "steps=2",
            "--out", tmp_path / "g.h5")
    assert r.exit_code == 0, r.stderr
    r = cli("fit-local", "--data", part / "client_0.h5", "--init", tmp_path / "g.h5", "--out", tmp_path / "x.h5")
    assert r.exit_code == 2 and "not an init file" in r.stderr
    assert cli("init", "--model", "mlp", "--model-kwargs", '{"in_features": 64, "hidden": 8}', "-M", 2,
               "--out", tmp_path / "i.h5").exit_code == 0
    r = cli("fit-local", "--data", part / "client_0.h5", "--init", tmp_path / "i.h5", "--model", "lenet",
            "--out", tmp_path / "x.h5")
    assert r.exit_code == 2 and "model asked for (--model)" in r.stderr and r.stderr.count("\n") == 1
    r = cli("fit-local", "--data", part / "client_0.h5", "--init", tmp_path / "i.h5", "--components", 7,
            "--out", tmp_path / "x.h5")
    assert r.exit_code == 2 and "holds 2 starting points" in r.stderr


PLUGIN = '''
from torch import nn


def tinynet(num_classes: int = 10, in_features: int = 64, width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, num_classes))
'''


def test_entry_point_plugin_end_to_end_and_refused_when_missing(tmp_path, digits, monkeypatch):
    install_fake_plugin(tmp_path, monkeypatch, "tinyplug", "0.3", "tinynet", PLUGIN)
    site = tmp_path / "site"
    part = digits / "part"
    spec = ModelSpec("tinynet", {"width": 6})
    assert spec.provider == "tinyplug==0.3"
    for c in range(2):
        r = cli("fit-local", "--data", part / f"client_{c}.h5", "--model", "tinynet", "--model-kwargs", '{"width": 6}',
                "-M", 2, "--epochs", 1, "--structure", "kron", "--train-seed", c, "--out", tmp_path / f"p{c}.h5")
        assert r.exit_code == 0, r.stderr
    r = cli("fuse", tmp_path / "p0.h5", tmp_path / "p1.h5", "--method", "fedbens", "--set", "steps=5", "--out", tmp_path / "g.h5")
    assert r.exit_code == 0, r.stderr
    r = cli("evaluate", tmp_path / "g.h5", "--data", part / "test.h5", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["accuracy"] > 0.1
    model = json.loads(cli("inspect", tmp_path / "p0.h5", "--json").stdout)["model"]
    assert model == {"name": "tinynet", "kwargs": {"width": 6}, "provider": "tinyplug==0.3"}
    with pytest.raises(ModelSpecError, match="takes no argument"):
        ModelSpec("tinynet", {"evil": 1})
    # without the package installed: one line, naming what to install
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(site)])
    for cmd in (["inspect", tmp_path / "p0.h5", "--validate"], ["fuse", tmp_path / "p0.h5", tmp_path / "p1.h5", "--out", tmp_path / "h.h5"]):
        r = cli(*cmd)
        assert r.exit_code == 2 and "tinyplug==0.3" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_partial_files_are_refused_and_marked(tmp_path, kron_artifact):
    import shutil

    from posterior_fusion.artifact import write_client_artifact

    art = posterior_fusion.load(kron_artifact)
    write_client_artifact(tmp_path / ".x.h5.partial.h5", art.model_spec, art.layout, dict(art.metadata, partial=True),
                          list(art.components))
    shutil.copy(kron_artifact, tmp_path / "ok.h5")
    r = cli("fuse", tmp_path / ".x.h5.partial.h5", tmp_path / "ok.h5", "--method", "fedavg", "--out", tmp_path / "g.h5")
    assert r.exit_code == 2 and "partial file" in r.stderr
    assert "PARTIAL" in cli("inspect", tmp_path / ".x.h5.partial.h5").stdout


def test_usage_errors_are_one_line(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-c", "from posterior_fusion.cli.main import main; main()", "fuse",
                           "--methd", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: No such option")


@pytest.mark.parametrize("kwargs", [{"width": 4}, {"width": 4, "norm": "group"}])
def test_resnet20_and_configurable_mlp_build_from_specs(kwargs):
    import torch

    spec = ModelSpec("resnet20", kwargs)
    assert spec.build()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    spec.check_input((3, 32, 32), "x")
    mlp = ModelSpec("mlp", {"in_features": 30, "hidden_sizes": [8, 4], "num_classes": 2})
    assert [m.out_features for m in mlp.build() if isinstance(m, torch.nn.Linear)] == [8, 4, 2]
    with pytest.raises(ModelSpecError, match="list"):
        ModelSpec("mlp", {"hidden_sizes": [0]})
    with pytest.raises(ModelSpecError, match="norm"):
        ModelSpec("resnet20", {"norm": "layer"}).build()
    from posterior_fusion.models.finetune import FrozenBatchNorm2d  # BatchNorm: statistics (0, 1), frozen

    assert any(isinstance(m, FrozenBatchNorm2d) for m in ModelSpec("resnet20", {"norm": "batch"}).build().modules())


def authors_partition_transcribed(y, n, alpha, num_c):
    """An independent transcription of the FedBEns authors' data.py on NumPy's global generator."""
    np.random.seed(3)
    p_client = np.zeros((n, num_c))
    for i in range(n):
        p_client[i] = np.random.dirichlet(np.repeat(alpha, num_c))
    idx_batch = [[] for _ in range(n)]
    for k in range(num_c):
        idx_k = np.where(y == k)[0]
        np.random.shuffle(idx_k)
        prop = p_client[:, k] / p_client[:, k].sum()
        prop = (np.cumsum(prop) * len(idx_k)).astype(int)[:-1]
        idx_batch = [a + b.tolist() for a, b in zip(idx_batch, np.split(idx_k, prop))]
    for j in range(n):
        np.random.shuffle(idx_batch[j])
    return idx_batch, np.random.choice(len(y), 500)


def test_fedbens_reference_partition_matches_the_authors_calls():
    from posterior_fusion.data.partition import fedbens_reference_partition

    y = np.random.default_rng(1).integers(0, 10, 2000)
    parts, val = fedbens_reference_partition(y, 5, 0.1, 10)
    ref_parts, ref_val = authors_partition_transcribed(y, 5, 0.1, 10)
    assert [p.tolist() for p in parts] == ref_parts
    np.testing.assert_array_equal(val, ref_val)


def test_fedbens_reference_client_sizes_on_the_full_data():
    from posterior_fusion.data.idx import SYSTEM_FMNIST_DIR, load_fmnist
    from posterior_fusion.data.partition import fedbens_reference_partition

    if not (SYSTEM_FMNIST_DIR / "train-labels-idx1-ubyte.gz").exists():
        pytest.skip("the full Fashion-MNIST (Debian package dataset-fashion-mnist) is not installed")
    _, y = load_fmnist("train", SYSTEM_FMNIST_DIR)
    parts, _ = fedbens_reference_partition(y, 5, 0.1, 10)
    assert [len(p) for p in parts] == [14962, 12151, 18845, 4849, 9193]


def test_progress_plain_lines_off_a_terminal_and_quiet(monkeypatch, capsys):
    from posterior_fusion import progress as prog

    monkeypatch.setattr(prog, "EVERY_SECONDS", 0.0)
    monkeypatch.setenv("PFUSE_PROGRESS", "1")
    assert list(prog.progress(range(3), "phase")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "phase: 3/3 (100%)" in err and err.count("\n") == 3
    monkeypatch.setenv("PFUSE_PROGRESS", "0")
    assert list(prog.progress(range(3), "phase")) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_reference_protocol_partition_files(tmp_path):
    from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR, load_fmnist
    from posterior_fusion.data.partition import fedbens_reference_partition

    r = cli("partition", "--protocol", "fedbens-reference", "--data-dir", EMBEDDED_FMNIST_DIR, "--alpha", 0.1,
            "--out-dir", tmp_path, "--json")
    assert r.exit_code == 0, r.stderr
    summary = json.loads(r.stdout)
    _, y = load_fmnist("train", EMBEDDED_FMNIST_DIR)
    parts, val = fedbens_reference_partition(y, 5, 0.1, 10)
    assert [c["n"] for c in summary["clients"]] == [len(p) for p in parts]
    v = read_silo(tmp_path / "server_val.h5")
    assert len(v) == 500 and v.transform.mean == (0.1307,) and v.transform.std == (0.3081,)
    np.testing.assert_array_equal(v.y, y[val])
    r = cli("partition", "--protocol", "fedbens-reference", "--scheme", "per-class", "--out-dir", tmp_path / "x")
    assert r.exit_code == 2 and "fixes the scheme" in r.stderr


def test_the_model_takes_its_sizes_from_the_data(tmp_path):
    """``--model mlp`` on 3-class, 13-feature wine builds a 13 -> 3 network by itself (it used to
    build 784 -> 10); an explicit value that disagrees with the data is refused in one line."""
    import posterior_fusion

    r = CliRunner().invoke(pfuse, ["import-data", "sklearn:wine", "--out", str(tmp_path / "wine.h5")])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "wine.h5"), "--model", "mlp", "-M", "1",
                                   "--epochs", "1", "--out", str(tmp_path / "w.h5")])
    assert r.exit_code == 0, r.stderr
    art = posterior_fusion.load(tmp_path / "w.h5")
    assert art.model_spec.kwargs == {"in_features": 13, "num_classes": 3} and art.model_spec.num_classes == 3
    assert len(art.metadata["class_counts"]) == 3
    for kwargs, key in (('{"num_classes": 10}', "num_classes=3"), ('{"in_features": 784}', "in_features=13")):
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "wine.h5"), "--model", "mlp",
                                       "--model-kwargs", kwargs, "--out", str(tmp_path / "x.h5")])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and key in r.stderr and "--model-kwargs" in r.stderr


def test_csv_label_column_typo_names_the_columns(tmp_path):
    """A misspelt --label-column says which columns exist (it used to blame a non-numeric feature);
    an unlabelled CSV with a text column names that column and the option to use."""
    (tmp_path / "wine.csv").write_text("alcohol,acid,cultivar\n13.2,1.7,a\n12.1,2.0,b\n")
    r = cli("import-data", tmp_path / "wine.csv", "--label-column", "cultivr", "--out", tmp_path / "w.h5")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "no column 'cultivr'" in r.stderr and "'cultivar'" in r.stderr and "'alcohol'" in r.stderr
    r = cli("import-data", tmp_path / "wine.csv", "--out", tmp_path / "w.h5")
    assert r.exit_code == 2 and "column 'cultivar' is not numeric" in r.stderr and "--label-column" in r.stderr
    r = cli("import-data", tmp_path / "wine.csv", "--label-column", "cultivar", "--out", tmp_path / "w.h5")
    assert r.exit_code == 0, r.stderr


def test_inspect_describes_a_data_file(tmp_path):
    r = cli("import-data", "sklearn:wine", "--out", tmp_path / "wine.h5")
    assert r.exit_code == 0, r.stderr
    r = cli("inspect", tmp_path / "wine.h5")
    assert r.exit_code == 0 and "data file: 178 samples of (13,)" in r.stdout and "[59, 71, 48]" in r.stdout
    r = cli("inspect", tmp_path / "wine.h5", "--json")
    d = json.loads(r.stdout)
    assert d["kind"] == "data" and d["num_classes"] == 3 and d["class_counts"] == [59, 71, 48]


def test_partition_on_small_data_says_which_option_to_lower(tmp_path):
    cli("import-data", "sklearn:wine", "--out", tmp_path / "wine.h5")
    r = cli("partition", "--data", tmp_path / "wine.h5", "--clients", "2", "--out-dir", tmp_path / "p")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "--val-size" in r.stderr and "178" in r.stderr
    r = cli("partition", "--from", tmp_path / "wine.h5", "--clients", "2", "--out-dir", tmp_path / "p")  # old spelling
    assert r.exit_code == 2 and "warning: --from is deprecated" in r.stderr and "178" in r.stderr


def test_image_folders_detect_greyscale_and_the_flags_force_it(tmp_path):
    """A folder of one-channel images imports as one channel (it used to become RGB silently);
    colour images as three; --rgb / --grey force either."""
    from PIL import Image

    for kind, mode in (("grey", "L"), ("colour", "RGB")):
        for c in range(2):
            (tmp_path / kind / f"class_{c}").mkdir(parents=True)
            for i in range(3):
                shape = (8, 8) if mode == "L" else (8, 8, 3)
                Image.fromarray(RNG.integers(0, 256, shape, dtype=np.uint8), mode).save(
                    tmp_path / kind / f"class_{c}" / f"{i}.png")
    import posterior_fusion as pf

    for kind, flags, channels in (("grey", [], 1), ("colour", [], 3), ("grey", ["--rgb"], 3), ("colour", ["--grey"], 1)):
        out = tmp_path / f"{kind}{''.join(flags)}.h5"
        r = cli("import-data", tmp_path / kind, *flags, "--out", out)
        assert r.exit_code == 0, r.stderr
        assert pf.read_data(out).inputs().shape[1] == channels, (kind, flags)


def test_the_readme_python_snippet_runs(tmp_path, monkeypatch, small_silo):
    """The README's Python API block runs as printed, on a run/ folder made here."""
    import re
    from pathlib import Path

    from conftest import fit_split

    from posterior_fusion.data.silo import SiloData, write_silo
    from posterior_fusion.fusion import fuse, write_fused

    run = tmp_path / "run"
    run.mkdir()
    paths = fit_split(run, small_silo, 2, 100, "kron", name="post")
    inputs, result, meta = fuse(paths, "fedbens", settings={"steps": 5})
    write_fused(run / "fedbens.h5", inputs, result, meta)
    write_silo(run / "test.h5", SiloData(small_silo.x[200:260], small_silo.y[200:260], "fmnist", 10))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Python API\n\n```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - the README's own code


def test_class_names_travel_from_a_csv_to_the_predictions(tmp_path):
    """A CSV whose labels are names: the data file stores the names (index = sorted order, as the labels),
    partition keeps them in every file, fit-local records them, fuse carries them to the global (refusing
    clients that name their classes otherwise), inspect shows them and predict writes them beside each
    row's predicted index."""
    import json

    import h5py
    import numpy as np

    import posterior_fusion
    from posterior_fusion.artifact import load

    gen = np.random.default_rng(0)
    names = ["bear", "cat", "dog"]
    rows = ["f0,f1,f2,label"]
    for i in range(240):
        k = i % 3
        x = gen.normal(size=3) + 3 * np.eye(3)[k]
        rows.append(",".join(f"{v:.4f}" for v in x) + f",{names[k]}")
    (tmp_path / "animals.csv").write_text("\n".join(rows) + "\n")
    runner = CliRunner()

    def ok(*args):
        r = runner.invoke(pfuse, [str(a) for a in args])
        assert r.exit_code == 0, r.output
        return r

    ok("import-data", tmp_path / "animals.csv", "--out", tmp_path / "a.h5")
    assert "class names: bear, cat, dog" in ok("inspect", tmp_path / "a.h5").output
    ok("partition", "--data", tmp_path / "a.h5", "--clients", "2", "--alpha", "10", "--val-size", "20",
       "--test-size", "40", "--out-dir", tmp_path / "p")
    for c in range(2):
        ok("fit-local", "--data", tmp_path / "p" / f"client_{c}.h5", "--model", "mlp", "-M", "1", "--epochs", "2",
           "--structure", "diag", "--train-seed", c, "--out", tmp_path / f"c{c}.h5")
        assert load(tmp_path / f"c{c}.h5").metadata["class_names"] == names
    ok("fuse", tmp_path / "c0.h5", tmp_path / "c1.h5", "--method", "fedavg", "--out", tmp_path / "g.h5")
    assert posterior_fusion.load(tmp_path / "g.h5").metadata["class_names"] == names
    assert "class names: bear, cat, dog" in ok("inspect", tmp_path / "c0.h5").output
    ok("predict", tmp_path / "g.h5", "--data", tmp_path / "p" / "test.h5", "--out", tmp_path / "probs.h5")
    with h5py.File(tmp_path / "probs.h5") as f:
        assert json.loads(f.attrs["class_names"]) == names
        np.testing.assert_array_equal(f["predicted"][...], f["probs"][...].argmax(1))
    # a client that names its classes otherwise is refused beside the others
    with h5py.File(tmp_path / "c1.h5", "r+") as f:
        meta = json.loads(f.attrs["metadata"])
        meta["class_names"] = ["ant", "bee", "cow"]
        del f.attrs["metadata"]
        f.attrs["metadata"] = np.bytes_(json.dumps(meta).encode())
    r = runner.invoke(pfuse, ["fuse", str(tmp_path / "c0.h5"), str(tmp_path / "c1.h5"), "--method", "fedavg",
                              "--out", str(tmp_path / "x.h5")])
    assert r.exit_code == 2 and "names its classes differently" in r.stderr, r.output


def test_integer_labels_with_a_stray_value_are_refused_not_renumbered(tmp_path):
    """One ``nan`` among integer labels 0–11: refused in one line naming the row (it used to turn the column into
    sorted class names, storing label 2 as 4); a column of names still maps to sorted classes."""
    rows = "".join(f"{i * 0.5},{i % 12}\n" for i in range(40)).replace(",7\n", ",nan\n", 1)
    (tmp_path / "mixed.csv").write_text("x,label\n" + rows)
    r = cli("import-data", tmp_path / "mixed.csv", "--out", tmp_path / "m.h5")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "'nan'" in r.stderr and "row 9" in r.stderr, r.stderr
    assert not (tmp_path / "m.h5").exists()
    (tmp_path / "named.csv").write_text("x,label\n1.0,cat\n2.0,dog\n3.0,cat\n")
    assert cli("import-data", tmp_path / "named.csv", "--out", tmp_path / "n.h5").exit_code == 0


def test_integer_token_ids_are_kept_or_the_standardisation_is_named(tmp_path):
    """Token ids stored as integers (an npz of int64): `--transform auto` would standardise them, and import-data says
    so in one warning line naming the way out; with `--transform none` they arrive as the ids, exactly, and nothing is
    said. Integer-valued floats (sklearn's digits: pixel counts) are features, not ids: no warning."""
    from posterior_fusion.data.silo import read_silo

    ids = np.random.default_rng(0).integers(0, 5000, size=(40, 12)).astype(np.int64)
    np.savez(tmp_path / "tokens.npz", x=ids, y=np.arange(40) % 3)
    r = CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "tokens.npz"), "--out", str(tmp_path / "a.h5")])
    assert r.exit_code == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "token ids" in warned[0] and "--transform none" in warned[0], r.stderr
    r = CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "tokens.npz"), "--transform", "none",
                                   "--out", str(tmp_path / "b.h5")])
    assert r.exit_code == 0 and "warning:" not in r.stderr, r.stderr
    kept = read_silo(tmp_path / "b.h5")
    assert np.array_equal(kept.inputs().numpy(), ids.astype(np.float32))
    np.savez(tmp_path / "counts.npz", x=ids.astype(np.float64), y=np.arange(40) % 3)
    r = CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "counts.npz"), "--out", str(tmp_path / "c.h5")])
    assert r.exit_code == 0 and "warning:" not in r.stderr, r.stderr


def test_class_names_come_from_an_npz_and_from_scikit_learn(tmp_path):
    """An npz's ``class_names`` member and a scikit-learn set's ``target_names`` name the classes of the file
    import-data writes (as a CSV's names and an image folder's sub-folders do); a malformed member names nothing."""
    from posterior_fusion.data.silo import read_silo

    x = np.random.default_rng(0).normal(size=(30, 4)).astype(np.float32)
    np.savez(tmp_path / "named.npz", x=x, y=np.arange(30) % 3, class_names=np.array(["ant", "bee", "cat"]))
    assert CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "named.npz"), "--out", str(tmp_path / "a.h5")]).exit_code == 0
    assert read_silo(tmp_path / "a.h5").class_names == ("ant", "bee", "cat")
    np.savez(tmp_path / "bad.npz", x=x, y=np.arange(30) % 3, class_names=np.zeros((3, 2)))
    assert CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "bad.npz"), "--out", str(tmp_path / "b.h5")]).exit_code == 0
    assert read_silo(tmp_path / "b.h5").class_names == ()
    assert CliRunner().invoke(pfuse, ["import-data", "sklearn:wine", "--out", str(tmp_path / "w.h5")]).exit_code == 0
    assert read_silo(tmp_path / "w.h5").class_names == ("class_0", "class_1", "class_2")
