"""`pfuse audit`: what a client artifact reveals about its silo — the stored label distribution, the first
layer's input factor against the silo's own input second moment (an independent reference from the data),
and a loss-threshold membership attack that finds an overfit silo and not a barely trained one."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, read_silo, write_silo


def _run(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


def test_audit_reads_labels_inputs_and_membership(tmp_path, small_silo):
    x, y = small_silo.x, small_silo.y
    write_silo(tmp_path / "s.h5", SiloData(x[:120, ::2, ::2].copy(), y[:120], "fmnist", 10))
    write_silo(tmp_path / "o.h5", SiloData(x[120:240, ::2, ::2].copy(), y[120:240], "fmnist", 10))
    write_silo(tmp_path / "h.h5", SiloData(x[240:300, ::2, ::2].copy(), y[240:300], "fmnist", 10))
    kw = '{"in_features": 196, "hidden": 256}'
    fits = {"over": ["--epochs", "150", "--lr", "0.1", "--weight-decay", "0"], "barely": ["--epochs", "1", "--lr", "0.001"]}
    reports = {}
    for name, extra in fits.items():
        r = _run("fit-local", "--data", tmp_path / "s.h5", "--model", "mlp", "--model-kwargs", kw, "-M", "1",
                 *extra, "--out", tmp_path / f"{name}.h5")
        assert r.exit_code == 0, r.output
        r = _run("audit", tmp_path / f"{name}.h5", "--data", tmp_path / "s.h5", "--holdout", tmp_path / "h.h5",
                 "--other", tmp_path / "o.h5", "--json")
        assert r.exit_code == 0, r.output
        reports[name] = json.loads(r.stdout)
    over, barely = reports["over"], reports["barely"]
    assert over["label_distribution"]["exact"] and over["label_distribution"]["stored_counts"] == \
        read_silo(tmp_path / "s.h5").class_counts()
    # the attack works where there is something to find, and finds little where there is not
    assert over["membership"]["auc"] > 0.7 and over["membership"]["auc"] > barely["membership"]["auc"] + 0.15, reports
    assert abs(barely["membership"]["auc"] - 0.5) < 0.15, barely
    # the input factor is the silo's own input second moment (independent reference from the data)
    art = posterior_fusion.load(tmp_path / "over.h5")
    inputs = read_silo(tmp_path / "s.h5").inputs().reshape(120, -1).double()
    A = art.components[0].curvature.blocks[0].A.double()
    torch.testing.assert_close(A, inputs.T @ inputs / 120, rtol=1e-4, atol=1e-6)
    stats = over["input_statistics"]
    assert stats["overlap_own"] > 0.99 and stats["overlap_unrelated"] < 0.05
    assert stats["overlap_other_silo"] < stats["overlap_own"]
    text = _run("audit", tmp_path / "over.h5", "--data", tmp_path / "s.h5", "--holdout", tmp_path / "h.h5")
    assert text.exit_code == 0 and "membership (loss threshold" in text.output and "AUC" in text.output
    wrong = _run("audit", tmp_path / "over.h5", "--data", tmp_path / "o.h5")
    assert wrong.exit_code == 2 and "is not the silo" in wrong.stderr and wrong.stderr.count("\n") == 1
