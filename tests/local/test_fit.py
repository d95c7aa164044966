"""``posterior_fusion.local.fit.fit_local``: the one fit-local of the CLI, the Flower node and the experiment
grid — the same silo through each gives the same artifact, bit for bit up to the recorded timings."""

from __future__ import annotations

import json

import h5py
import numpy as np
from click.testing import CliRunner

from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import write_silo
from posterior_fusion.experiment.grid import FitJob
from posterior_fusion.flower.client_app import fit_to_artifact
from posterior_fusion.flower.federated_settings import FederatedSettings
from posterior_fusion.local.fit_config import fit_config_from
from posterior_fusion.models import ModelSpec

TIMINGS = ("train_seconds", "curvature_seconds")


def _without_timings(value):
    """A JSON attribute's value with every recorded duration removed (they differ from run to run)."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _contents(path) -> dict:
    """Every dataset's bytes and every attribute (JSON ones without timings) of an HDF5 file, by path."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            for key, value in obj.attrs.items():
                if isinstance(value, (bytes, np.bytes_)) or isinstance(value, str):
                    text = value.decode() if isinstance(value, (bytes, np.bytes_)) else value
                    try:
                        value = json.dumps(_without_timings(json.loads(text)), sort_keys=True)
                    except json.JSONDecodeError:
                        value = text
                else:
                    value = np.asarray(value).tobytes()
                out[f"{name}@{key}"] = value
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj.dtype.str, obj.shape, obj[()].tobytes())
        visit("/", f)
        f.visititems(visit)
    return out


def test_the_cli_the_flower_node_and_the_grid_write_the_same_artifact(tmp_path, small_silo):
    silo = tmp_path / "silo.h5"
    write_silo(silo, small_silo.subset(np.arange(200)))
    fit = {"structure": "kron", "epochs": 1, "batch_size": 32, "train_seed": 1}
    spec = ModelSpec("mlp", {"hidden": 16}).fitted_to((28, 28), 10, str(silo))

    cli = tmp_path / "cli.h5"
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(silo), "--model", "mlp", "--model-kwargs",
                                   json.dumps({"hidden": 16}), "--components", "2", "--init-seed", "3",
                                   "--structure", "kron", "--epochs", "1", "--batch-size", "32", "--train-seed", "1",
                                   "--out", str(cli)])
    assert r.exit_code == 0, r.output
    node = tmp_path / "node.h5"
    fit_to_artifact(FederatedSettings(model=spec.name, model_kwargs=dict(spec.kwargs), components=2, init_seed=3,
                                      **fit), silo, node)
    grid = tmp_path / "grid.h5"
    FitJob(str(silo), str(grid), spec.to_json(), 2, 3, fit_config_from(fit)).run()

    reference = _contents(cli)
    with h5py.File(cli, "r") as f:  # the timings were there to drop
        assert set(TIMINGS) <= set(json.loads(f["components/0"].attrs["training"]))
    for other in (node, grid):
        got = _contents(other)
        assert got.keys() == reference.keys(), (other, set(got) ^ set(reference))
        differing = [k for k in reference if got[k] != reference[k]]
        assert not differing, (other.name, differing)


def test_a_capture_far_costlier_than_kfac_is_estimated_and_warned_before_training(tmp_path, small_silo, monkeypatch):
    """Before training, a diag capture is timed on a few inputs beside K-FAC's and scaled to the silo and M: where it
    would take minutes and many times K-FAC's, fit-local warns in one line with the estimate (the clock is replaced
    here: tests never time); where it is cheap, nothing is said; K-FAC itself is never timed."""
    from posterior_fusion.local import fit_checks
    from posterior_fusion.local.fit_config import FitConfig

    silo = tmp_path / "silo.h5"
    write_silo(silo, small_silo.subset(np.arange(64)))
    timed = []

    def clock(per_input: dict):
        def seconds(model, x, y, structure, cfg):
            timed.append(structure)
            return per_input[structure] * len(x)
        return seconds

    def fit(structure: str) -> str:
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(silo), "--model", "mlp", "--model-kwargs",
                                       json.dumps({"hidden": 8}), "-M", "2", "--epochs", "1", "--structure", structure,
                                       "--out", str(tmp_path / f"{structure}.h5")])
        assert r.exit_code == 0, r.output
        return r.stderr

    monkeypatch.setattr(fit_checks, "capture_seconds", clock({"diag": 2.0, "kron": 0.01}))
    warned = [line for line in fit("diag").splitlines() if line.startswith("warning: the diag capture")]
    assert len(warned) == 1 and "about 4 min for 2 component(s) of 64 inputs, 200x what K-FAC takes" in warned[0], warned
    assert "--structure kron" in warned[0] and timed == ["diag", "kron"]
    timed.clear()
    monkeypatch.setattr(fit_checks, "capture_seconds", clock({"diag": 0.001, "kron": 0.0001}))
    assert "warning: the diag capture" not in fit("diag")
    timed.clear()
    assert "warning:" not in fit("kron") and timed == []
    # the real clock runs too, on the real capture (its value is not asserted)
    monkeypatch.undo()
    from posterior_fusion.models import ModelSpec as Spec

    model = Spec("mlp", {"hidden": 8, "in_features": 784}).build()
    x, y = small_silo.subset(np.arange(16)).tensors()
    assert fit_checks.capture_seconds(model, x, y, "diag", FitConfig(structure="diag")) > 0


def test_quiet_lasts_one_invocation(tmp_path, small_silo, monkeypatch):
    """``pfuse -q`` silences the progress of that command only: a later in-process invocation shows its lines."""
    monkeypatch.delenv("PFUSE_PROGRESS", raising=False)
    silo = tmp_path / "silo.h5"
    write_silo(silo, small_silo.subset(np.arange(64)))
    args = ["fit-local", "--data", str(silo), "--model", "mlp", "--model-kwargs", json.dumps({"hidden": 8}), "-M", "1",
            "--epochs", "1", "--structure", "diag"]
    quiet = CliRunner().invoke(pfuse, ["-q", *args, "--out", str(tmp_path / "a.h5")])
    assert quiet.exit_code == 0 and "fit-local: n = 64" not in quiet.stderr
    loud = CliRunner().invoke(pfuse, [*args, "--out", str(tmp_path / "b.h5")])
    assert loud.exit_code == 0 and "fit-local: n = 64" in loud.stderr, loud.stderr
