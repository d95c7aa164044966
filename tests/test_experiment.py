"""The experiment runner on the smoke config: tables, plots, caching/resume, tuning."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from posterior_fusion.errors import ConfigError
from posterior_fusion.experiment import ExperimentConfig, run_experiment

SMOKE = Path(__file__).resolve().parent / "smoke.toml"


def test_smoke_grid_tables_plots_and_resume(tmp_path):
    cfg = ExperimentConfig.from_toml(SMOKE)
    logs: list[str] = []
    rows = run_experiment(cfg, tmp_path, jobs=1, log=logs.append)
    # 2 alphas x 2 seeds x (2 M x 2 methods + 1 temperature) + centralized per cell
    assert len(rows) == 2 * 2 * (2 * 2 + 1) + 2 * 2
    assert sum("fitted" in m for m in logs) == 2 * 2 * 3  # every client of every cell, once
    with open(tmp_path / "results.csv") as fh:
        agg = list(csv.DictReader(fh))
    assert {(r["method"], r["M"]) for r in agg} >= {("fedbens", "1"), ("fedbens", "2"), ("fedavg", "2"), ("centralized", "1")}
    assert all(r["seeds"] == "2" for r in agg)
    assert "± " in (tmp_path / "results.md").read_text()
    # serving cost beside accuracy, NLL and ECE: fedbens serves its M modes, FedAvg one network
    members = {(r["method"], r["M"]): r["members"] for r in agg}
    assert members[("fedbens", "2")] == "2" and members[("fedavg", "2")] == "1"
    assert all(0 <= float(r["ece_mean"]) <= 1 for r in agg)
    assert "| members |" in (tmp_path / "results.md").read_text()
    for plot in ("accuracy_vs_alpha.png", "accuracy_vs_M.png", "accuracy_vs_temperature.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"
    # M=1 fusion uses the first component of the M=2 fit: fedavg does not depend on M at all.
    by = {(r["alpha"], r["seed"], r["method"], r["M"]): r["accuracy"] for r in rows}
    assert by[(0.5, 0, "fedavg", 1)] == by[(0.5, 0, "fedavg", 2)]
    # Re-running refits nothing and refuses nothing: everything comes from the cache.
    logs2: list[str] = []
    again = run_experiment(cfg, tmp_path, jobs=1, log=logs2.append)
    assert not any("fitted" in m or "accuracy" in m for m in logs2)
    assert sorted(map(str, again)) == sorted(map(str, rows))
    # A new method reuses the cached client artifacts.
    logs3: list[str] = []
    run_experiment(replace(cfg, methods=["fedbens", "fedavg", "fisher-merge"]), tmp_path, log=logs3.append)
    assert not any("fitted" in m for m in logs3) and any("fisher-merge" in m for m in logs3)


def test_tables_keep_client_counts_apart(tmp_path):
    """A grid over several client counts (Table 2) gets one column and one section per (C, α): the
    C = 40 cells must not overwrite the C = 10 ones (they did before, the tables being keyed by α)."""
    from posterior_fusion.experiment.report import write_tables

    rows = [{"structure": "kron", "M": 5, "method": "fedbens", "temperature": 0.1, "alpha": 0.3, "clients": c,
             "seed": seed, "accuracy": acc, "nll": 0.5, "ece": 0.05, "members": 5}
            for c, accs in ((10, (0.81, 0.83)), (40, (0.77, 0.79))) for seed, acc in enumerate(accs)]
    cfg = replace(ExperimentConfig.from_toml(SMOKE), name="two-counts")
    write_tables(rows, tmp_path, cfg)
    md = (tmp_path / "results.md").read_text()
    assert "| structure | M | method | T | C=10, α=0.3 | C=40, α=0.3 |" in md
    assert "| kron | 5 | fedbens | 0.1 | 82.00 ± 1.41 (2) | 78.00 ± 1.41 (2) |" in md
    assert "C = 10, α = 0.3:" in md and "C = 40, α = 0.3:" in md
    assert (tmp_path / "accuracy_vs_clients.png").read_bytes()[:4] == b"\x89PNG"  # one α, several C: against C
    write_tables([r for r in rows if r["clients"] == 10], tmp_path, cfg)  # one count: columns by α alone
    assert "| structure | M | method | T | α=0.3 |" in (tmp_path / "results.md").read_text()


def test_a_fit_cached_by_an_older_version_beside_new_ones_is_refitted(tmp_path):
    """A client folder mixing a fit that records no input transform (an older version's, e.g. an
    interrupted grid resumed after an upgrade) with fits that record one would be refused at fusion;
    the grid refits the odd one instead, and leaves a folder that is consistent as it is."""
    import json

    import h5py
    import numpy as np

    cfg = replace(ExperimentConfig.from_toml(SMOKE), alphas=[0.5], seeds=[0], components=[2], methods=["fedavg"])
    run_experiment(cfg, tmp_path, jobs=1, log=lambda m: None)
    (cdir,) = [d for d in (tmp_path / "clients").iterdir()]

    def drop_transform(path):
        with h5py.File(path, "r+") as f:
            meta = json.loads(f.attrs["metadata"])
            del meta["input_transform"]
            f.attrs["metadata"] = np.bytes_(json.dumps(meta).encode())  # fixed-length UTF-8, as written

    drop_transform(cdir / "post_1.h5")
    logs: list[str] = []
    run_experiment(cfg, tmp_path, jobs=1, log=logs.append)
    assert any("making" in m and "post_1.h5" in m for m in logs)
    assert sum("fitted" in m for m in logs) == 1
    with h5py.File(cdir / "post_1.h5", "r") as f:
        assert "input_transform" in json.loads(f.attrs["metadata"])
    for path in sorted(cdir.glob("post_*.h5")):  # all without: consistent, nothing refitted
        drop_transform(path)
    logs.clear()
    run_experiment(replace(cfg, methods=["fedavg", "fisher-merge"]), tmp_path, jobs=1, log=logs.append)
    assert not any("fitted" in m or "making" in m for m in logs) and any("fisher-merge" in m for m in logs)


def test_bad_config_is_refused(tmp_path):
    (tmp_path / "bad.toml").write_text('name = "x"\nalphas = [0.1]\nmethod = ["fedbens"]\n')
    with pytest.raises(ConfigError, match="unknown keys"):
        ExperimentConfig.from_toml(tmp_path / "bad.toml")
    (tmp_path / "bad2.toml").write_text('methods = ["magic"]\n')
    with pytest.raises(ConfigError, match="unknown methods"):
        ExperimentConfig.from_toml(tmp_path / "bad2.toml")


def test_fuse_tune_picks_best_validation_point(tmp_path, small_silo):
    from click.testing import CliRunner
    from conftest import fit_artifact

    import posterior_fusion
    from posterior_fusion.cli.main import pfuse
    from posterior_fusion.data.silo import SiloData, write_silo

    paths = []
    for c in range(2):
        silo = SiloData(small_silo.x[c * 100 : (c + 1) * 100], small_silo.y[c * 100 : (c + 1) * 100], "fmnist", 10)
        paths.append(tmp_path / f"p{c}.h5")
        fit_artifact(paths[-1], silo, "diag", mixtures=1, seed=c)
    write_silo(tmp_path / "val.h5", SiloData(small_silo.x[200:], small_silo.y[200:], "fmnist", 10))
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedbens", "--set", "steps=5", "--val",
                                   str(tmp_path / "val.h5"), "--tune", "T,prior", "--tune-temperatures", "0.1,10",
                                   "--tune-prior-vars", "0.1,1", "--out", str(tmp_path / "g.h5")])
    assert r.exit_code == 0, r.stderr
    tuning = posterior_fusion.load(tmp_path / "g.h5").metadata["tuning"]
    assert len(tuning["grid"]) == 4
    best = max(tuning["grid"], key=lambda g: (g["val_accuracy"], -g["val_nll"]))
    assert tuning["chosen"] == best
    # two-point grids: the best is always at an edge, said in one warning that names the options to widen
    warned = [line for line in r.stderr.splitlines() if "edge of its grid" in line]
    assert len(warned) == 1 and "--tune-temperatures" in warned[0] and tuning["at_grid_edge"] is True, r.stderr
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedbens", "--tune", "T", "--out", str(tmp_path / "h.h5")])
    assert r.exit_code != 0 and "needs server validation" in r.stderr
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedbens", "--tune", "lr", "--val", str(tmp_path / "val.h5"),
                                   "--out", str(tmp_path / "h.h5")])
    assert r.exit_code != 0 and "--tune takes" in r.stderr


def test_parallel_jobs_give_the_same_artifacts(tmp_path):
    """--jobs 2 fits clients in spawned processes; results equal the sequential run."""
    cfg = replace(ExperimentConfig.from_toml(SMOKE), alphas=[0.5], seeds=[0], components=[1], methods=["fedavg"],
                  temperatures=[], centralized=False)
    seq = run_experiment(cfg, tmp_path / "seq", jobs=1, log=lambda m: None)
    par = run_experiment(cfg, tmp_path / "par", jobs=2, log=lambda m: None)
    assert [r["accuracy"] for r in seq] == pytest.approx([r["accuracy"] for r in par], abs=0.02)


def test_fits_cached_under_an_older_key_are_found_not_refitted(tmp_path):
    """A grid resumed after the cache-key scheme changed finds the cell's fits by the data hash
    and settings the artifacts record."""
    import shutil

    cfg = replace(ExperimentConfig.from_toml(SMOKE), alphas=[0.5], seeds=[0], components=[1], methods=["fedavg"],
                  temperatures=[], tune=False, centralized=False)
    first = run_experiment(cfg, tmp_path, jobs=1, log=lambda m: None)
    (cdir,) = list((tmp_path / "clients").iterdir())
    old = cdir.with_name("0123456789abcdef")  # as if written under another key
    shutil.move(cdir, old)
    shutil.rmtree(tmp_path / "results")
    logs: list[str] = []
    again = run_experiment(cfg, tmp_path, jobs=1, log=logs.append)
    assert not any("fitting client" in m for m in logs)
    assert any("reusing the fits in" in m and old.name in m for m in logs)
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in first]
    # other settings (another number of epochs) are not matched: those clients are fitted anew
    logs = []
    run_experiment(replace(cfg, epochs=cfg.epochs + 1), tmp_path, jobs=1, log=logs.append)
    assert any("fitting client" in m for m in logs)


def test_further_structures_recapture_the_first_structures_training(tmp_path):
    """share_training: the diag clients are the kron clients' MAPs recaptured, and give the results
    of diag clients fitted from scratch."""
    cfg = replace(ExperimentConfig.from_toml(SMOKE), alphas=[0.5], seeds=[0], components=[1],
                  methods=["fedavg", "fisher-merge"], structures=["kron", "diag"], temperatures=[], tune=False,
                  centralized=False)
    logs: list[str] = []
    shared = run_experiment(cfg, tmp_path / "shared", jobs=1, log=logs.append)
    assert sum("fitting client" in m for m in logs) == 3 and sum("recapturing client" in m for m in logs) == 3
    fresh = run_experiment(replace(cfg, share_training=False), tmp_path / "fresh", jobs=1, log=lambda m: None)
    acc = {(r["structure"], r["method"]): r["accuracy"] for r in shared}
    assert acc == {(r["structure"], r["method"]): r["accuracy"] for r in fresh}
    assert acc[("kron", "fedavg")] == acc[("diag", "fedavg")]


def test_a_recaptured_kron_structure_uses_the_grids_kfac(tmp_path):
    """[fit] kfac applies to a kron structure recaptured from the first structure's training (the
    diag source records no K-FAC type)."""
    from posterior_fusion.artifact import load_client

    cfg = replace(ExperimentConfig.from_toml(SMOKE), alphas=[0.5], seeds=[0], components=[1], methods=["fedavg"],
                  structures=["diag", "kron"], temperatures=[], tune=False, centralized=False, fit={"kfac": "reduce"})
    run_experiment(cfg, tmp_path, jobs=1, log=lambda m: None)
    kinds = {}
    for cdir in (tmp_path / "clients").iterdir():
        meta = load_client(cdir / "post_0.h5").metadata
        kinds[meta["structure"]] = (meta.get("kfac"), "recaptured_from" in meta)
    assert kinds == {"diag": (None, False), "kron": ("reduce", True)}


def test_an_interrupted_client_fit_resumes_from_its_partial_file(tmp_path):
    from posterior_fusion.artifact import load_client, write_client_artifact
    from posterior_fusion.local.resume import partial_path

    cfg = replace(ExperimentConfig.from_toml(SMOKE), alphas=[0.5], seeds=[0], components=[2], methods=["fedavg"],
                  temperatures=[], tune=False, centralized=False)
    first = run_experiment(cfg, tmp_path, jobs=1, log=lambda m: None)
    (cdir,) = list((tmp_path / "clients").iterdir())
    done = load_client(cdir / "post_0.h5")  # as if the run had stopped after component 1 of client 0
    write_client_artifact(partial_path(cdir / "post_0.h5"), done.model_spec, done.layout,
                          dict(done.metadata, partial=True), done.components[:1])
    (cdir / "post_0.h5").unlink()
    logs: list[str] = []
    again = run_experiment(cfg, tmp_path, jobs=1, log=logs.append)
    assert any("resuming: 1 of 2 components already done" in m for m in logs)
    assert sum("component 2/2" in m for m in logs) >= 1 and not any("component 1/2:" in m for m in logs)
    assert not partial_path(cdir / "post_0.h5").exists()
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in first]


@pytest.mark.parametrize("path", sorted(SMOKE.parent.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_grid_config_is_valid(path):
    cfg = ExperimentConfig.from_toml(path)
    assert cfg.seeds and cfg.structures and cfg.methods


def test_unlabeled_server_data_is_held_out_and_feeds_distillation(tmp_path):
    import numpy as np

    from posterior_fusion.data.silo import read_silo

    cfg = ExperimentConfig(name="unl", data="embedded", max_train=300, alphas=[1.0], clients=[2], seeds=[0],
                           components=[1], methods=["fedavg", "fedbe", "ensemble", "fedbens"],
                           variants={"fedbens-clients": {"method": "fedbens", "starts": "clients"}},
                           distill=["ensemble", "fedbens-clients"],
                           model="mlp", epochs=1, steps=5, val_size=50, unlabeled_size=100, centralized=False)
    cfg.validate()
    rows = {r["method"]: r for r in run_experiment(cfg, tmp_path, log=lambda m: None)}
    part = next((tmp_path / "partitions").iterdir())
    unl = read_silo(part / "server_unlabeled.h5", labels=False)
    assert len(unl) == 100 and unl.y is None
    silos = [read_silo(part / f"client_{i}.h5") for i in range(2)]
    assert sum(len(s) for s in silos) == 300  # max_train counts the clients' samples only
    rows_of = lambda d: {r.tobytes() for r in d.x}  # noqa: E731
    held = rows_of(unl)
    assert not held & rows_of(read_silo(part / "server_val.h5")) and not any(held & rows_of(s) for s in silos)
    # the ensemble of 2 client models and its distillation into one; fedbe distils by itself
    assert rows["ensemble"]["members"] == 2 and rows["ensemble+distill"]["members"] == 1
    assert rows["fedbe"]["members"] == 1
    # a variant is a method with its own settings, one more row: fedbens from every client start
    assert rows["fedbens"]["members"] == 1 and rows["fedbens-clients"]["members"] == 2
    assert rows["fedbens-clients+distill"]["members"] == 1
    assert rows["ensemble+distill"]["fuse_seconds"] > rows["ensemble"]["fuse_seconds"]
    assert np.isfinite(rows["ensemble+distill"]["nll"])
    with pytest.raises(ConfigError, match="unlabeled_size"):
        ExperimentConfig(distill=["fedbens"], methods=["fedbens"]).validate()
    with pytest.raises(ConfigError, match="no setting 'startz'"):
        ExperimentConfig(variants={"v": {"method": "fedbens", "startz": "clients"}}).validate()
    with pytest.raises(ConfigError, match="not a method's"):
        ExperimentConfig(variants={"fedavg": {"method": "fedbens"}}).validate()
    with pytest.raises(ConfigError, match="not among methods"):
        ExperimentConfig(distill=["fedbe"], methods=["fedbens"], unlabeled_size=10).validate()


def test_result_keys_ignore_settings_at_their_defaults(monkeypatch):
    """A fusion result's cache key holds only the settings that differ from their defaults: naming a
    default explicitly, or a method gaining a setting later (at its default), keeps the key; a
    changed value changes it; the legacy key (the whole record) is what earlier versions wrote."""
    import dataclasses

    from posterior_fusion.experiment import grid
    from posterior_fusion.fusion import method_settings

    base = {"alpha": 0.1, "clients": 5, "seed": 0, "structure": "kron", "M": 5, "method": "fedbens", "temperature": 0.1}
    key, legacy = grid.result_keys("c", base, 300, "fedbens", {})
    assert grid.result_keys("c", base, 300, "fedbens", {"clip": 1.0}) == (key, legacy)
    assert grid.result_keys("c", base, 300, "fedbens", {"clip": 2.0})[0] != key
    assert legacy == grid.cache_key({"c": "c", **base, "steps": 300,
                                     "settings": dataclasses.asdict(method_settings("fedbens", {}))})
    real = grid.method_settings

    def with_a_new_setting(method, settings):
        record = real(method, settings)
        grown = dataclasses.make_dataclass("Grown", [("brand_new", float, dataclasses.field(default=0.0))],
                                           bases=(type(record),), frozen=True)
        return grown(**dataclasses.asdict(record))

    monkeypatch.setattr(grid, "method_settings", with_a_new_setting)
    new_key, new_legacy = grid.result_keys("c", base, 300, "fedbens", {})
    assert new_key == key and new_legacy != legacy
