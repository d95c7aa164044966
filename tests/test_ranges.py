"""Every number a user gives has a declared range, refused in one line before any work: CLI options, settings, experiment grids."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli, one_error_line

from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError
from posterior_fusion.experiment.grid_config import ExperimentConfig


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", "", "x" * 101, "/abs"])
def test_experiment_names_are_one_folder_name(tmp_path, name):
    cfg = tmp_path / "g.toml"
    cfg.write_text(f"name = {json.dumps(name)}\n")
    with pytest.raises(ConfigError, match="one folder name"):
        ExperimentConfig.from_toml(cfg)


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


def test_evaluate_bins_are_bounded(tmp_path, two_clients, silo_file):
    g = tmp_path / "g.h5"
    assert cli("fuse", *two_clients, "--method", "fedavg", "--out", g).exit_code == 0
    for bins in ("1000000000", "0", "-3"):
        assert "bins" in one_error_line(cli("evaluate", g, "--data", silo_file, "--bins", bins))


@pytest.mark.parametrize("body", ['alphas = "0.1"', 'steps = "100"', 'name = "a\\u0000b"', "methods = [1]",
                                  "epochs = 1.5", "centralized = 3", "max_train = -1"])
def test_toml_values_of_the_wrong_type_end_in_one_line(tmp_path, body):
    (tmp_path / "g.toml").write_text(body + "\n")
    one_error_line(cli("experiment", tmp_path / "g.toml", "--out-dir", tmp_path / "w"))


def _commands():
    import click

    from cli.main import pfuse as group

    ctx = click.Context(group)
    return [(name, group.get_command(ctx, name)) for name in group.list_commands(ctx)]


def test_every_numeric_option_and_setting_declares_its_range():
    """Walks every option of every command: a number is a click range with finite ends (refused before the
    command runs), or a fit setting whose declaration carries bounds (checked by ``fit_config_from`` before
    any work), or a hidden old spelling whose value the new option's type checks. Every numeric setting of
    every fusion method and of the fit declares bounds."""
    import math

    import click

    from posterior_fusion.compat import RENAMED_OPTIONS
    from posterior_fusion.fusion.registry import METHODS
    from posterior_fusion.local.fit_config import fit_settings
    from posterior_fusion.settings import describe

    fit = {s.name: s for s in fit_settings()}
    missing = []
    for name, cmd in _commands():
        old = {o.lstrip("-").replace("-", "_") for o in RENAMED_OPTIONS.get(name, {})}
        for p in cmd.params:
            if isinstance(p.type, (click.IntRange, click.FloatRange)):
                if p.type.min is None or p.type.max is None or not math.isfinite(p.type.max):
                    missing.append(f"{name} {p.name}: open range")
            elif isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType)):
                setting = fit.get(p.name)
                if setting is not None and setting.bounds is not None:
                    continue
                if p.hidden and (p.name.removeprefix("deprecated_") in old or p.name.startswith("legacy_")):
                    continue
                missing.append(f"{name} {p.name}")
    for method in METHODS.values():
        for field in describe(method.settings):
            if field["type"] in ("int", "float", "int | None", "float | None") and field["bounds"] is None:
                missing.append(f"method {method.name} setting {field['name']}")
    assert not missing, missing


@pytest.mark.parametrize("args,word", [
    (["demo", "--steps", "-5", "--out-dir", "{tmp}/d"], "--steps"),
    (["demo", "--alpha", "nan", "--out-dir", "{tmp}/d"], "--alpha"),
    (["fuse", "{tmp}/a.h5", "--distill-epochs", "1000000000", "--out", "{tmp}/g.h5"], "--distill-epochs"),
    (["partition", "--clients", "0", "--out-dir", "{tmp}/p"], "--clients"),
    (["fit-local", "--data", "{tmp}/s.h5", "--epochs", "1000000000", "--out", "{tmp}/c.h5"], "epochs"),
    (["fit-local", "--data", "{tmp}/s.h5", "--ppd", "--ppd-step-size", "inf", "--out", "{tmp}/c.h5"], "step_size"),
    (["fit-local", "--data", "{tmp}/s.h5", "--seed", "-1", "--out", "{tmp}/c.h5"], "--train-seed"),
    (["evaluate", "{tmp}/g.h5", "--data", "{tmp}/s.h5", "--samples", "0"], "--samples"),
])
def test_an_out_of_range_option_is_one_line_before_any_work(tmp_path, args, word, monkeypatch, capsys):
    """Out-of-range values (negative, NaN, inf, absurdly large; also through an old spelling), given to the
    console entry point, end in one ``error:`` line and exit 2 before anything is read, trained, printed or
    written."""
    from cli.main import main

    monkeypatch.setattr("sys.argv", ["pfuse", *[a.format(tmp=tmp_path) for a in args]])
    with pytest.raises(SystemExit) as stop:
        main()
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).strip().splitlines() if not line.startswith("warning:")]
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], (out, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_device_and_method_needs_are_checked_before_any_work(tmp_path, small_silo, monkeypatch, capsys):
    """An experiment asking for ``device = "cuda"`` where none is visible is refused before it partitions;
    ``fuse -q`` with a method whose needs the inputs lack (unlabeled data, FedPPD students, SWAG moments)
    prints nothing but its one error line."""
    from conftest import fit_artifact

    from cli.main import main
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.experiment.grid_config import ExperimentConfig

    if not torch.cuda.is_available():
        (tmp_path / "e.toml").write_text('name = "x"\ndata = "system"\nalphas = [0.4]\nclients = [2]\nseeds = [0]\n'
                                         'components = [1]\nstructures = ["diag"]\nmethods = ["fedavg"]\n'
                                         '[fit]\ndevice = "cuda"\n')
        with pytest.raises(ConfigError, match=r"\[fit\] device cuda: no CUDA device"):
            ExperimentConfig.from_toml(tmp_path / "e.toml")
    silo = SiloData(small_silo.x[:40, ::4, ::4].copy(), small_silo.y[:40], "fmnist", 10)
    for c in range(2):
        fit_artifact(tmp_path / f"c{c}.h5", silo, "diag", kwargs={"in_features": 49, "hidden": 2}, mixtures=1,
                     epochs=1, seed=c)
    for method, words in (("fedppd-distill", "needs unlabeled server data"), ("fedppd", "needs FedPPD students"),
                          ("swag", "needs SWAG moments")):
        monkeypatch.setattr("sys.argv", ["pfuse", "-q", "fuse", str(tmp_path / "c0.h5"), str(tmp_path / "c1.h5"),
                                         "--method", method, "--out", str(tmp_path / "g.h5")])
        with pytest.raises(SystemExit) as stop:
            main()
        out, err = capsys.readouterr()
        lines = (out + err).strip().splitlines()
        assert stop.value.code == 2 and len(lines) == 1 and words in lines[0], (method, out, err)
        assert not (tmp_path / "g.h5").exists()
