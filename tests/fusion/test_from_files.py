"""``posterior_fusion/fusion/from_files.py``: ``fuse --dry-run`` says, from the headers alone, what the fusion will
hold — the same estimate the fusion itself records — and writes nothing; over the memory limit it is refused in one
line, as the fusion would be."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from click.testing import CliRunner
from conftest import TINY, TINY_LAYOUT, fit_split, random_clients, raw_tensors

import posterior_fusion
from posterior_fusion.artifact import Component, write_client_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionInputs,
    FusionOptions,
    fuse,
)
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings
from posterior_fusion.fusion.registry import get_method

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


def test_a_dry_run_reports_what_the_fusion_holds_and_writes_nothing(tmp_path, small_silo):
    two_clients = fit_split(tmp_path, small_silo, 2, 100, "diag", mixtures=2)
    out = tmp_path / "g.h5"
    args = ["fuse", *map(str, two_clients), "--method", "fedavg", "--out", str(out)]
    r = CliRunner().invoke(pfuse, [*args, "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert not out.exists()
    assert plan["clients"] == 2 and plan["artifact_bytes"] == sum(p.stat().st_size for p in two_clients)
    text = CliRunner().invoke(pfuse, [*args, "--dry-run"])
    assert text.exit_code == 0 and "2 client headers valid" in text.stdout and "nothing fused" in text.stdout
    assert CliRunner().invoke(pfuse, args).exit_code == 0
    assert posterior_fusion.load(out).metadata["memory_estimate_bytes"] == plan["memory_estimate_bytes"]
    small = CliRunner().invoke(pfuse, [*args, "--dry-run", "--max-memory", str(plan["memory_estimate_bytes"] - 1)])
    assert small.exit_code == 2 and small.stderr.count("\n") == 1 and "over the limit" in small.stderr


def _federation(folder, silo, clients: int) -> list:
    """``clients`` artifacts of one fitted MLP whose K-FAC input factors dominate the file (784 inputs, 2 hidden
    units: 2.5 MB of curvature a component, 6 kB of weights), each copy's MAPs moved so every file differs."""
    import shutil

    import h5py
    import numpy as np
    from conftest import fit_artifact

    first = folder / "c_0.h5"
    fit_artifact(first, silo, "kron", kwargs={"hidden": 2})
    paths = [first]
    for c in range(1, clients):
        paths.append(folder / f"c_{c}.h5")
        shutil.copy(first, paths[-1])
        with h5py.File(paths[-1], "r+") as f:
            for k in f["components"]:
                f[f"components/{k}/map"][...] = f[f"components/{k}/map"][...] + np.float32(1e-4 * c)
    return paths


def test_the_pool_fedavg_and_fisher_merge_hold_no_client_curvature_at_a_hundred_clients(tmp_path, small_silo):
    """At C = 100 the label-shift pool, FedAvg and the Fisher merge hold the curvature of at most 20 clients at
    once, measured (by construction two blocks, or one client's for the Fisher merge, which folds the clients into
    its sums one at a time: each client's checked block by block, then dropped; the rest is the allocator's
    noise, up to 45 MiB seen): the fusion's peak resident memory grows from C = 2 by less than 20 clients'
    curvature plus the 100 clients' weights, where keeping the curvature (the robust pool, which reads it) grows
    it by most of the 490 MB. Measured as each fusion process's peak RSS."""
    from conftest import run_measured

    from posterior_fusion.artifact.reader import declared_bytes

    paths = _federation(tmp_path, small_silo, 100)
    header = declared_bytes(paths[0])
    curvature = 100 * header["curvature_bytes"]
    assert curvature > 400 * 2**20  # the measurement has something to see
    pfuse_bin = [sys.executable, "-c", "from posterior_fusion.cli.main import main; main()", "-q", "fuse"]

    def peak(method_args: list[str], clients: list) -> int:
        r, kib = run_measured([*pfuse_bin, *map(str, clients), *method_args, "--out", str(tmp_path / "g.h5")])
        assert r.returncode == 0, r.stderr
        (tmp_path / "g.h5").unlink()
        return kib * 1024

    slack = 20 * header["curvature_bytes"] + 3 * 100 * (header["data_bytes"] - header["curvature_bytes"])
    for method in (["--method", "ensemble", "--set", "pooling=label-shift"], ["--method", "fedavg"],
                   ["--method", "fisher-merge"]):  # fisher-merge reads each client's curvature, one at a time
        small, large = peak(method, paths[:2]), peak(method, paths)
        assert large - small < slack, (method, small / 2**20, large / 2**20)
    kept = peak(["--method", "ensemble", "--set", "pooling=label-shift", "--set", "robust=true"], paths) \
        - peak(["--method", "ensemble", "--set", "pooling=label-shift", "--set", "robust=true"], paths[:2])
    assert kept > 0.8 * curvature, kept / 2**20


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


def test_write_then_fuse_through_artifacts_matches_in_memory(tmp_path):
    clients = random_clients("kron", C=2, M=2, seed=3)
    paths = []
    for i, c in enumerate(clients):
        paths.append(tmp_path / f"c{i}.h5")
        comps = [Component(k.index, k.map.float(), BlockDiag([type(b)(*[t.float() for t in raw_tensors(b)]) for b in k.curvature.blocks]), {}, 0.5, 2.0)
                 for k in c.components]
        write_client_artifact(paths[-1], TINY, TINY_LAYOUT, dict(c.metadata), comps)
    _, res, _ = fuse(paths, "fedbens", FusionOptions(progress=False), {"steps": 5})
    mem = fedbens(FusionInputs(clients, FusionOptions(progress=False)), FedBEnsSettings(steps=5))
    for a, b in zip(res.members, mem.members):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def test_fuse_on_the_gpu_is_refused_when_its_working_set_exceeds_the_free_gpu_memory(fitted, monkeypatch):
    """`device` cuda checks the GPU's own working set (stacked curvature, the method's work, members)
    against the memory free on the GPU before anything is loaded; one line naming the GPU."""
    from posterior_fusion.artifact.reader import declared_bytes
    from posterior_fusion.errors import ResourceLimitError
    from posterior_fusion.fusion.resources import estimate_device_bytes

    folder, paths = fitted
    headers = [declared_bytes(p) for p in paths]
    settings = get_method("fedbens").settings()
    need = estimate_device_bytes(headers, "fedbens", settings)
    d, K = headers[0]["num_params"], headers[0]["num_components"]
    assert need == 2 * sum(h["data_bytes"] for h in headers) + get_method("fedbens").work_bytes(
        settings, posterior_fusion.fusion.method_type.FuseSize(d, len(headers), K)) + K * d * 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (need, 80 * 2**30))  # 90 % of it is too little
    loaded = []
    monkeypatch.setattr(posterior_fusion.fusion.from_files, "load_client", lambda *a, **k: loaded.append(a))
    with pytest.raises(ResourceLimitError, match="of GPU memory, over 90% of the .* free on the GPU"):
        fuse(paths, "fedbens", FusionOptions(device="cuda", progress=False))
    assert not loaded  # refused before any artifact is loaded


def test_a_folded_fisher_merge_equals_the_one_that_holds_every_client_and_refuses_a_changed_file(tmp_path,
                                                                                                  small_silo):
    """The Fisher merge from files folds the clients into its sums one at a time (each read again with its
    curvature): its member is bit for bit the one computed on clients held with their curvature, and a file that
    changed between its two reads is refused in one line naming it."""
    import shutil

    from conftest import fit_split

    from posterior_fusion.artifact.reader import load_client
    from posterior_fusion.errors import IncompatibleArtifactsError
    from posterior_fusion.fusion.from_files import _with_curvature, folds_clients, fuse
    from posterior_fusion.fusion.from_posteriors import fuse_clients
    from posterior_fusion.fusion.settings_parsing import MethodSettings

    paths = fit_split(tmp_path, small_silo, 3, 60, "kron", mixtures=1, epochs=1)
    assert folds_clients("fisher-merge", MethodSettings()) and not folds_clients("fisher-merge", MethodSettings(), True)
    inputs, folded, _ = fuse(paths, "fisher-merge")
    assert all(c.components[0].curvature is None for c in inputs.clients)  # held without it
    _, held, _ = fuse_clients([load_client(p) for p in paths], "fisher-merge")
    assert torch.equal(folded.members[0], held.members[0])
    light = load_client(paths[0], keep_curvature=False)
    shutil.copy(paths[1], paths[0])
    with pytest.raises(IncompatibleArtifactsError, match=f"{paths[0]}: changed while it was being fused"):
        _with_curvature(light, None)
