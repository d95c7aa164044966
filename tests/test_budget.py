"""The memory budget (`--max-memory`) before every reader, every fusion and every predictive."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import child, cli, one_error_line

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact, write_global_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.data.silo import SiloData, read_silo, write_silo
from posterior_fusion.errors import (
    ResourceLimitError,
)
from posterior_fusion.fusion import from_files as server
from posterior_fusion.fusion import fuse
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component, frozen_mapping


def test_memory_budget_applies_to_every_reader(tmp_path, kron_artifact, small_silo):
    with pytest.raises(ResourceLimitError, match="loading"):
        posterior_fusion.load(kron_artifact, max_memory=1000)
    write_silo(tmp_path / "s.h5", small_silo)
    with pytest.raises(ResourceLimitError, match="reading"):
        read_silo(tmp_path / "s.h5", max_memory="10K")
    for args in (["inspect", str(kron_artifact), "--validate"], ["fit-local", "--data", str(tmp_path / "s.h5"), "--out",
                                                   str(tmp_path / "o.h5")]):
        r = CliRunner().invoke(pfuse, [*args, "--max-memory", "1K"])
        assert r.exit_code == 2 and "over the limit" in r.stderr and r.stderr.count("\n") == 1
    r = CliRunner().invoke(pfuse, ["fuse", str(kron_artifact), "--method", "fedbe", "--set", "num_samples=1000000",
                                   "--out", str(tmp_path / "g.h5"), "--max-memory", "1G"])
    assert r.exit_code == 2 and "fedbe" in r.stderr and "over the limit" in r.stderr


def test_glm_predictive_stays_under_the_budget(tmp_path, two_clients, small_silo):
    """The GLM predictive on 2,000 images under --max-memory: the run succeeds, its peak stays
    under the limit, and a limit too small for one batch is refused in one line."""
    test = tmp_path / "test.h5"
    write_silo(test, SiloData(small_silo.x[:2000], small_silo.y[:2000], "fmnist", 10))
    g = tmp_path / "g.h5"
    assert cli("fuse", *two_clients, "--method", "fedbens", "--set", "steps=5", "--out", g).exit_code == 0
    proc, rss = child("evaluate", g, "--data", test, "--predictive", "glm", "--max-memory", "700M", "--json")
    assert proc.returncode == 0, proc.stderr
    assert rss < 700, rss
    proc, _ = child("evaluate", g, "--data", test, "--predictive", "glm", "--max-memory", "1M")
    assert "over the limit" in one_error_line(proc)


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


def test_memory_limit_refuses_before_loading(tmp_path, honest, monkeypatch):
    _, paths = honest

    def no_load(path):
        raise AssertionError("artifacts must not be loaded when the estimate is over the limit")

    monkeypatch.setattr(server, "load_client", no_load)
    with pytest.raises(ResourceLimitError, match="GiB"):
        fuse(paths, "fedbens", max_memory=1000)
    monkeypatch.undo()
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--max-memory", "1K", "--out", str(tmp_path / "g.h5")])
    assert r.exit_code != 0 and "over the limit" in r.stderr and not (tmp_path / "g.h5").exists()
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--max-memory", "lots", "--out", str(tmp_path / "g.h5")])
    assert r.exit_code != 0 and "memory size" in r.stderr
