"""The product's flow through the CLI: partition -> init -> fit-local -> fuse -> evaluate/predict -> inspect."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.idx import EMBEDDED_FMNIST_DIR
from posterior_fusion.data.silo import read_silo
from posterior_fusion.demo import run_demo


def invoke(*args: str):
    result = CliRunner().invoke(pfuse, list(args))
    assert result.exit_code == 0, f"pfuse {' '.join(args)} failed:\n{result.stderr}"
    return result


def test_partition_is_disjoint_and_complete(tmp_path):
    out = invoke("partition", "--clients", "4", "--alpha", "0.3", "--partition-seed", "1", "--out-dir", str(tmp_path),
                 "--data-dir", str(EMBEDDED_FMNIST_DIR), "--val-size", "200", "--min-size", "50", "--json")
    summary = json.loads(out.stdout)
    silos = [read_silo(c["path"]) for c in summary["clients"]]
    val = read_silo(tmp_path / "server_val.h5")
    rows = {x.tobytes() for s in silos for x in s.x}
    assert sum(len(s) for s in silos) + len(val) == 6000
    assert min(len(s) for s in silos) >= 50 and len(val) == 200
    # Server validation shares no image with any client (disjoint draws).
    assert not any(x.tobytes() in rows for x in val.x)
    assert [c["class_counts"] for c in summary["clients"]] == [s.class_counts() for s in silos]
    again = invoke("partition", "--clients", "4", "--alpha", "0.3", "--partition-seed", "1", "--out-dir", str(tmp_path / "b"),
                   "--data-dir", str(EMBEDDED_FMNIST_DIR), "--val-size", "200", "--min-size", "50", "--json")
    assert [c["class_counts"] for c in json.loads(again.stdout)["clients"]] == [c["class_counts"] for c in summary["clients"]]
    # --unlabeled-size: a further held-out split without labels, disjoint from the clients and validation
    third = json.loads(invoke("partition", "--clients", "4", "--alpha", "0.3", "--out-dir", str(tmp_path / "c"),
                              "--data-dir", str(EMBEDDED_FMNIST_DIR), "--val-size", "200", "--unlabeled-size", "300",
                              "--json").stdout)
    unl = read_silo(third["server_unlabeled"], labels=False)
    assert len(unl) == 300 and unl.y is None
    held = {x.tobytes() for s in [read_silo(c["path"]) for c in third["clients"]] for x in s.x}
    held |= {x.tobytes() for x in read_silo(third["server_val"]).x}
    assert sum(c["n"] for c in third["clients"]) == 6000 - 200 - 300 and not any(x.tobytes() in held for x in unl.x)
    # --val-size 0: every training sample goes to a client, no validation file is written
    none = json.loads(invoke("partition", "--clients", "3", "--alpha", "0.3", "--out-dir", str(tmp_path / "e"),
                             "--data-dir", str(EMBEDDED_FMNIST_DIR), "--val-size", "0", "--json").stdout)
    assert none["server_val"] is None and not (tmp_path / "e" / "server_val.h5").exists()
    assert sum(c["n"] for c in none["clients"]) == 6000
    bad = CliRunner().invoke(pfuse, ["partition", "--out-dir", str(tmp_path / "d"), "--data-dir", str(EMBEDDED_FMNIST_DIR),
                                     "--unlabeled-size", "5900"])
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "lower --unlabeled-size" in bad.stderr


def test_full_cli_flow(tmp_path):
    d = tmp_path
    invoke("partition", "--clients", "2", "--alpha", "1.0", "--out-dir", str(d), "--data-dir", str(EMBEDDED_FMNIST_DIR),
           "--max-train", "400", "--val-size", "100")
    invoke("init", "--model", "mlp", "--model-kwargs", '{"hidden": 16}', "-M", "2", "--init-seed", "3", "--out", str(d / "init.h5"))
    for c in range(2):
        invoke("fit-local", "--data", str(d / f"client_{c}.h5"), "--init", str(d / "init.h5"), "--structure", "kron",
               "--epochs", "1", "--train-seed", str(c), "--swag", "--out", str(d / f"post_{c}.h5"))
    init = posterior_fusion.load(d / "init.h5")
    post = posterior_fusion.load(d / "post_0.h5")
    assert post.num_components == 2 and post.model_spec == init.model_spec
    invoke("fuse", str(d / "post_0.h5"), str(d / "post_1.h5"), "--method", "fedbens", "--val", str(d / "server_val.h5"),
           "--set", "steps=10", "--out", str(d / "global.h5"))
    ev = json.loads(invoke("evaluate", str(d / "global.h5"), "--data", str(d / "test.h5"), "--json",
                           "--plot", str(d / "rel.png")).stdout)
    assert 0 <= ev["ece"] <= 1 and ev["member_accuracy_min"] <= ev["accuracy"] + 0.2 and ev["n"] == 1000
    assert (d / "rel.png").read_bytes()[:4] == b"\x89PNG"
    invoke("predict", str(d / "global.h5"), "--data", str(d / "test.h5"), "--out", str(d / "probs.h5"))
    with h5py.File(d / "probs.h5") as f:
        probs = f["probs"][()]
    assert probs.shape == (1000, 10) and np.allclose(probs.sum(1), 1, atol=1e-5)
    assert ev["accuracy"] == pytest.approx((probs.argmax(1) == read_silo(d / "test.h5").y).mean(), abs=1e-6)
    text = invoke("inspect", str(d / "global.h5")).stdout
    assert "fedbens" in text and "members: 2" in text


def test_help_lists_every_option_default():
    for cmd in ("partition", "init", "fit-local", "fuse", "evaluate", "predict", "inspect", "demo"):
        out = invoke(cmd, "--help").stdout
        assert "Usage:" in out
    assert "--help-method NAME" in invoke("fuse", "--help").stdout
    assert "[default: 300]" in invoke("fuse", "--help-method", "fedbens").stdout


def test_demo_smoke(tmp_path):
    logs = []
    rows = run_demo(tmp_path, subset=True, clients=3, components=2, epochs=1, steps=10, max_train=900,
                    methods=("fedbens", "fedavg", "product"), log=logs.append)
    assert any(m.startswith("data: the embedded Fashion-MNIST subset") and "not representative" in m for m in logs)
    assert [r["method"] for r in rows] == ["fedbens", "fedavg"]  # product refuses kron and is skipped
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)


def test_demo_uses_the_installed_full_fashion_mnist(monkeypatch, tmp_path):
    """The full set when Debian's package is installed (faked here by pointing the system folder at
    a copy of the embedded files), the embedded subset otherwise or with ``subset``."""
    import shutil

    import posterior_fusion.data.idx as idx
    from posterior_fusion import demo

    fake = tmp_path / "share" / "fashion-mnist"
    shutil.copytree(idx.EMBEDDED_FMNIST_DIR, fake)
    monkeypatch.setattr(idx, "SYSTEM_FMNIST_DIR", fake)
    monkeypatch.setattr(demo, "SYSTEM_FMNIST_DIR", fake)
    folder, text = demo.fmnist_source()
    assert folder == fake and text.startswith("the full Fashion-MNIST")
    folder, text = demo.fmnist_source(subset=True)
    assert folder == idx.EMBEDDED_FMNIST_DIR and "subset" in text
    monkeypatch.setattr(idx, "SYSTEM_FMNIST_DIR", tmp_path / "missing")
    monkeypatch.setattr(demo, "SYSTEM_FMNIST_DIR", tmp_path / "missing")
    assert demo.fmnist_source()[0] == idx.EMBEDDED_FMNIST_DIR


def test_demo_offers_only_the_methods_that_apply():
    from posterior_fusion.demo import demo_methods

    assert "product" not in demo_methods("kron") and "regmean" in demo_methods("kron")
    assert "product" in demo_methods("diag") and "regmean" not in demo_methods("diag")


def test_a_diverging_fit_stops_in_its_first_epoch_with_one_line(tmp_path, small_silo):
    """A learning rate that sends the loss to NaN stops training at the end of that epoch (SGD does not come back
    from NaN) with one error line naming the setting to change; the output is not written."""
    from posterior_fusion.data.silo import write_silo

    write_silo(tmp_path / "s.h5", small_silo)
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "mlp", "--model-kwargs",
                                   '{"hidden": 16}', "-M", "1", "--epochs", "10", "--lr", "1000", "--structure", "diag",
                                   "--out", str(tmp_path / "p.h5")])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert "training diverged in epoch" in errors[0] and "of 10" in errors[0] and "--lr (1000)" in errors[0], errors
    assert "epoch 10 of 10" not in errors[0]  # stopped when the loss left the finite numbers, not after the last epoch
    assert not (tmp_path / "p.h5").exists()
