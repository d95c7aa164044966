"""Fourth security pass (docs/security.md): the silo's trust boundary in the refresh round (in
``tests/local/test_recapture.py`` and ``test_flower.py``), writers whose output their own reader accepts, caps
enforced where the work starts, compressed blocks at the float32 edge, the Python API's inputs."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact, write_global_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag, Diag, Kron
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import OutputError
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component, frozen_mapping

SPEC = ModelSpec("mlp", {"in_features": 6, "num_classes": 3, "hidden_sizes": [], "bias": True})
META = {"n_data": 30, "class_counts": [10, 10, 10], "temperature": 1.0, "prior_precision": 1.0, "structure": "kron"}


def _component(B: torch.Tensor, A: torch.Tensor) -> Component:
    layout = ParameterLayout.from_model(SPEC.build())
    return Component(0, torch.zeros(layout.dim), BlockDiag([Kron(B, A), Diag(torch.ones(3))]),
                     frozen_mapping({"seed": 0}), 1.0, 1.0)


def test_a_factor_with_a_rounding_negative_diagonal_is_written_so_its_reader_accepts_it(tmp_path):
    """A K-FAC factor whose diagonal holds −1.6e-16 next to near-zero entries (a capture's rounding, as on a
    ResNet-20 layer) is written with that entry at 0 and every other entry as given; the reader accepts it."""
    layout = ParameterLayout.from_model(SPEC.build())
    g = torch.Generator().manual_seed(0)
    m = torch.randn(6, 2, generator=g)
    A = m @ m.T
    A[5, :] = A[:, 5] = 0.0
    A[5, 5] = -1.58e-16
    B = torch.eye(3) * 2.0
    write_client_artifact(tmp_path / "a.h5", SPEC, layout, META, [_component(B, A)])
    got = posterior_fusion.load(tmp_path / "a.h5").components[0].curvature.blocks[0].A
    want = A.clone()
    want[5, 5] = 0.0
    assert torch.equal(got, want)


def test_a_writer_never_leaves_a_file_its_reader_refuses(tmp_path):
    """A factor the reader refuses (asymmetric far beyond its tolerance) makes the writer fail in one line
    naming the output and the reader's reason; no file is left, an existing one stays as it was."""
    layout = ParameterLayout.from_model(SPEC.build())
    A = torch.eye(6)
    A[0, 1] = 5.0  # not symmetric
    out = tmp_path / "a.h5"
    with pytest.raises(OutputError, match=r"a\.h5: not written: its own reader would refuse it \(.*not symmetric"):
        write_client_artifact(out, SPEC, layout, META, [_component(torch.eye(3), A)])
    assert not out.exists()
    write_client_artifact(out, SPEC, layout, META, [_component(torch.eye(3), torch.eye(6))])
    before = out.read_bytes()
    with pytest.raises(OutputError):
        write_client_artifact(out, SPEC, layout, META, [_component(torch.eye(3), A)])
    assert out.read_bytes() == before
    with pytest.raises(OutputError, match="not written"):  # a global member count past the reader's cap
        write_global_artifact(tmp_path / "g.h5", SPEC, layout, {"method": "fedavg"},
                              [torch.zeros(layout.dim)] * 1025)
    assert not (tmp_path / "g.h5").exists()


def test_an_init_file_with_more_starting_points_than_the_cap_is_refused_before_training(tmp_path, small_silo):
    """``fit-local --init`` of a file holding 257 starting points: one line naming the file, exit 2, before
    any training (no progress line), nothing written."""
    silo = SiloData(small_silo.x[:40, ::4, ::4].copy(), small_silo.y[:40], "fmnist", 10)
    write_silo(tmp_path / "s.h5", silo)
    spec = ModelSpec("mlp", {"in_features": 49, "hidden": 2})
    layout = ParameterLayout.from_model(spec.build())
    write_global_artifact(tmp_path / "init.h5", spec, layout, {"method": "init"}, [torch.zeros(layout.dim)] * 257)
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--init", str(tmp_path / "init.h5"),
                                   "--epochs", "1", "--out", str(tmp_path / "c.h5")])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "init.h5: holds 257 starting points" in lines[0], r.output
    assert not (tmp_path / "c.h5").exists()


def test_curvature_beyond_the_declared_scale_is_refused_and_at_the_edge_fusion_stays_finite(tmp_path):
    """Each block's largest curvature eigenvalue (bounded by a trace, a product of traces or the largest
    diagonal entry) is at most ``CURVATURE_MAX``: a Kronecker block of two 1e20 factors or a diagonal of 1e30
    is refused by the writer's read-back and the reader in one line; clients at the edge (largest eigenvalue
    just under the bound) fuse with fedbens, fisher-merge and fedavg to finite weights or one error line."""
    from posterior_fusion.artifact.blocks import CURVATURE_MAX

    layout = ParameterLayout.from_model(SPEC.build())
    with pytest.raises(OutputError, match="curvature too large"):
        write_client_artifact(tmp_path / "k.h5", SPEC, layout, META, [_component(1e20 * torch.eye(3), 1e20 * torch.eye(6))])
    comp = Component(0, torch.zeros(layout.dim), BlockDiag([Diag(torch.full((layout.dim,), 1e30))]),
                     frozen_mapping({"seed": 0}), 1.0, 1.0)
    with pytest.raises(OutputError, match="curvature too large"):
        write_client_artifact(tmp_path / "d.h5", SPEC, layout, dict(META, structure="diag"), [comp])
    paths = []
    g = torch.Generator().manual_seed(0)
    for c in range(2):
        edge = (0.99 * CURVATURE_MAX / 18) ** 0.5  # tr(B)·tr(A) = 3·edge · 6·edge = 0.99 · CURVATURE_MAX
        B, A = edge * torch.eye(3), edge * torch.eye(6)
        comp = Component(0, torch.randn(layout.dim, generator=g), BlockDiag([Kron(B, A), Diag(torch.ones(3))]),
                         frozen_mapping({"seed": 0}), 1.0, 1.0)
        paths.append(tmp_path / f"edge_{c}.h5")
        write_client_artifact(paths[-1], SPEC, layout, META, [comp])
    runner = CliRunner()
    for method in ("fedbens", "fisher-merge", "fedavg"):
        out = tmp_path / f"g_{method}.h5"
        r = runner.invoke(pfuse, ["fuse", *map(str, paths), "--method", method, "--out", str(out)])
        if r.exit_code == 0:
            assert all(torch.isfinite(w).all() for w in posterior_fusion.load(out).members), method
        else:
            assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, (method, r.output)


def test_the_python_api_refuses_inputs_it_cannot_predict_on(tmp_path, small_silo):
    """``ClientPosterior.predict`` and ``GlobalEnsemble.predict`` (map, glm, mc; with and without ``raw``) on
    NaN, Inf, 1e300, no rows, a meta tensor or a wrong shape: one typed error naming the problem, never NaN
    probabilities; inputs that overflow the logits: NonFiniteOutputError."""
    from conftest import fit_artifact

    from posterior_fusion.errors import ConfigError, NonFiniteOutputError, PfuseError

    silo = SiloData(small_silo.x[:60, ::4, ::4].copy(), small_silo.y[:60], "fmnist", 10)
    fit_artifact(tmp_path / "c.h5", silo, "diag", kwargs={"in_features": 49, "hidden": 4}, mixtures=1, epochs=1)
    client = posterior_fusion.load(tmp_path / "c.h5")
    comp = client.components[0]
    write_global_artifact(tmp_path / "g.h5", client.model_spec, client.layout,
                          {"method": "fedbens", "laplace": {"prior_precision": 1.0}}, [comp.map],
                          [comp.curvature])
    glob = posterior_fusion.load(tmp_path / "g.h5")
    good = silo.x[:4].astype("float64")
    assert torch.isfinite(glob.predict(good, "glm")).all()
    nan, inf, big = good.copy(), good.copy(), good.copy()
    nan[1, 0, 0], inf[2, 3, 3], big[0, 1, 1] = float("nan"), float("inf"), 1e300
    cases = [(nan, "NaN or Inf (first in row 1)"), (inf, "NaN or Inf (first in row 2)"), (big, "beyond float32"),
             (good[:0], "no rows"), (torch.empty(4, 7, 7, device="meta"), "meta tensor"),
             (good[:, :5, :5], "do not fit model"), (good[0, 0, 0], "real array")]
    def through(predictive):
        return lambda x, raw: glob.predict(x, predictive, samples=3, raw=raw)

    calls = [lambda x, raw: client.predict(x, raw=raw)] + [through(p) for p in ("map", "glm", "mc")]
    for x, words in cases:
        for call in calls:
            for raw in (False, True):
                if raw and words == "beyond float32":
                    continue  # raw: 1e300 is refused the same way (float32 conversion), covered without raw
                with pytest.raises(PfuseError, match=words.replace("(", r"\(").replace(")", r"\)")):
                    call(x, raw)
    overflow = torch.full((2, 49), 3e38)
    for call in calls:
        try:
            probs = call(overflow, True)
        except PfuseError as exc:
            assert isinstance(exc, (NonFiniteOutputError, ConfigError)), exc
        else:
            assert torch.isfinite(probs).all()


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


def test_compact_blocks_count_as_the_dense_factors_methods_rebuild(tmp_path, monkeypatch):
    """Compressed client artifacts (rank 0: a few kB each, the dense input factor 512² floats): each method
    that rebuilds or decomposes the factors (``dense_copies`` > 0) estimates that many dense copies, so
    ``fuse --max-memory`` just under its estimate refuses in one line before any artifact is loaded; the
    mc predictive of a global whose member curvature is compact counts its eigenbases the same way.
    ``benchmarks/compact_memory.py`` measures each method's peak against its estimate (docs/security.md)."""
    import posterior_fusion.fusion.from_files as from_files
    from posterior_fusion.artifact.reader import declared_bytes
    from posterior_fusion.curvature.compressed import Compression
    from posterior_fusion.errors import ResourceLimitError
    from posterior_fusion.fusion.registry import METHODS
    from posterior_fusion.fusion.resources import estimate_fuse_bytes

    D = 512
    spec = ModelSpec("mlp", {"in_features": D, "num_classes": 4, "hidden_sizes": [], "bias": False})
    layout = ParameterLayout.from_model(spec.build())
    meta = {"n_data": 40, "class_counts": [10] * 4, "temperature": 1.0, "prior_precision": 1.0, "structure": "kron"}
    paths = []
    for c in range(3):
        comps = [Component(m, torch.zeros(layout.dim), BlockDiag([Kron(2.0 * torch.eye(4), 0.5 * torch.eye(D))]),
                           frozen_mapping({"seed": m}), 1.0, 1.0) for m in range(2)]
        paths.append(tmp_path / f"c{c}.h5")
        write_client_artifact(paths[-1], spec, layout, meta, comps, Compression(0.05))
    headers = [declared_bytes(p) for p in paths]
    dense = sum(h["dense_bytes"] - h["data_bytes"] for h in headers)
    assert dense >= 6 * 4 * D * D and all(p.stat().st_size < dense / 20 for p in paths)

    def no_load(*args, **kwargs):
        raise AssertionError("loaded before the memory check")

    monkeypatch.setattr(from_files, "load_client", no_load)
    runner = CliRunner()
    heavy = [name for name, m in METHODS.items() if m.dense_copies > 0 and m.applies_to("kron")]
    assert {"fedbens", "regmean", "fedlpa", "hbfl"} <= set(heavy)
    for name in heavy:
        entry = METHODS[name]
        estimate = estimate_fuse_bytes(headers, name, entry.settings())
        plain = estimate_fuse_bytes([dict(h, dense_bytes=h["data_bytes"]) for h in headers], name, entry.settings())
        assert estimate - plain == pytest.approx(entry.dense_copies * dense)
        r = runner.invoke(pfuse, ["fuse", *map(str, paths), "--method", name, "--max-memory", str(int(0.9 * estimate)),
                                  "--out", str(tmp_path / "g.h5")])
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and "needs about" in lines[0], (name, r.output)
    monkeypatch.undo()
    client = posterior_fusion.load(paths[0])
    curv = client.components[0].curvature
    write_global_artifact(tmp_path / "g.h5", spec, layout, {"method": "fedbens", "laplace": {"prior_precision": 1.0}},
                          [client.components[0].map], [curv])
    glob = posterior_fusion.load(tmp_path / "g.h5")
    x = torch.zeros(3, D)
    with pytest.raises(ResourceLimitError, match="eigenbases"):
        glob.predict(x, "mc", samples=2, raw=True, max_memory=4 * D * D)
    assert torch.isfinite(glob.predict(x, "mc", samples=2, raw=True)).all()


def test_models_take_the_transformed_inputs_predict_takes_raw_ones(tmp_path, small_silo):
    """``GlobalEnsemble.models()`` are the members as modules on the model's inputs (after the artifact's
    input transform, as documented): on transformed inputs a one-member global's module gives
    ``predict``'s probabilities on the raw ones."""
    from conftest import fit_artifact

    from posterior_fusion.data.transform import InputTransform

    silo = SiloData(small_silo.x[:40, ::4, ::4].copy(), small_silo.y[:40], "fmnist", 10)
    fit_artifact(tmp_path / "c.h5", silo, "diag", kwargs={"in_features": 49, "hidden": 3}, mixtures=1, epochs=1)
    c = posterior_fusion.load(tmp_path / "c.h5")
    write_global_artifact(tmp_path / "g.h5", c.model_spec, c.layout, {"method": "fedavg",
                          "input_transform": c.metadata["input_transform"]}, [c.components[0].map])
    g = posterior_fusion.load(tmp_path / "g.h5")
    x = silo.x[:8]
    model_inputs = InputTransform.from_dict(g.metadata["input_transform"], "x").apply(x, "x")
    with torch.no_grad():
        probs = torch.softmax(g.models()[0](model_inputs), -1)
    torch.testing.assert_close(probs, g.predict(x), rtol=1e-5, atol=1e-6)


def test_the_demo_script_answers_help_without_setting_up(tmp_path):
    """``bash scripts/demo.sh --help`` prints its usage and installs nothing (a stand-in set-up script that
    leaves a mark is never run)."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "scripts" / "demo.sh", tmp_path / "scripts" / "demo.sh")
    (tmp_path / "scripts" / "setup.sh").write_text(f"touch {tmp_path / 'ran'}\n")
    for flag in ("--help", "-h"):
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "demo.sh"), flag], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0 and "usage" in r.stdout and not (tmp_path / "ran").exists(), (r.stdout, r.stderr)


def test_a_miscalibrated_fusion_warns_with_what_helps(tmp_path, small_silo):  # 300 samples
    """``fuse --val``: a fused model whose validation ECE is at least 0.15 gets one warning saying which way
    it errs and what helps (for fedbens, whose fit T changes: `--tune T`); a calibrated one gets none."""
    from conftest import fit_split

    from posterior_fusion.fusion.from_files import MISCALIBRATED_ECE

    paths = fit_split(tmp_path, small_silo, 2, 100, "diag", mixtures=1, epochs=1)
    write_silo(tmp_path / "val.h5", SiloData(small_silo.x[200:], small_silo.y[200:], "fmnist", 10))
    seen = {}
    for method, extra in (("fedavg", []), ("fedbens", ["--set", "steps=3"])):
        r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", method, *extra, "--val",
                                       str(tmp_path / "val.h5"), "--out", str(tmp_path / f"{method}.h5")])
        assert r.exit_code == 0, r.output
        warned = [line for line in r.stderr.splitlines() if "confident on the validation data" in line]
        ece = posterior_fusion.load(tmp_path / f"{method}.h5")
        from posterior_fusion.data.silo import read_silo
        from posterior_fusion.metrics import evaluate_members
        m = evaluate_members(ece.model_spec, list(ece.members), read_silo(tmp_path / "val.h5"), weights=ece.mode_weights)
        assert len(warned) == (1 if m["ece"] >= MISCALIBRATED_ECE else 0), (method, m["ece"], r.stderr)
        seen[method] = (m["ece"], warned)
        if warned and method == "fedbens":
            assert "--tune T" in warned[0]
    assert any(w for _, w in seen.values()), seen  # the construction miscalibrates at least one


def test_weights_beyond_the_declared_bound_and_featureless_imports_are_one_line(tmp_path):
    """A client artifact whose FedPPD student (or MAP) holds 3e38 — finite in float32, its average not — is
    refused by the reader (one line naming the dataset) before any fusion; ``import-data`` of inputs with no
    features, or with more features than a computed transform holds, names the file and the cause."""
    import h5py
    import numpy as np

    from posterior_fusion.artifact.reader import WEIGHT_MAX

    layout = ParameterLayout.from_model(SPEC.build())
    comp = _component(torch.eye(3), torch.eye(6))
    comp = Component(0, comp.map, comp.curvature, comp.training, 1.0, 1.0, student=torch.zeros(layout.dim))
    write_client_artifact(tmp_path / "c.h5", SPEC, layout, META, [comp])
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
