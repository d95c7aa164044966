"""Untrusted input at fuse time: fuzzed files, poisoned clients, memory limits."""

from __future__ import annotations

import random
import shutil

import h5py
import pytest
import torch
from click.testing import CliRunner
from conftest import fit_artifact, fit_split

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ArtifactError, ConfigError, ResourceLimitError
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.fusion import from_files as server
from posterior_fusion.fusion.robust import screen_clients
from posterior_fusion.posterior import Component


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory, small_silo):
    path = tmp_path_factory.mktemp("fuzz") / "tiny.h5"
    silo = SiloData(small_silo.x[:64], small_silo.y[:64], "fmnist", 10)
    fit_artifact(path, silo, "kron", kwargs={"hidden": 4}, mixtures=2, swag=True)
    return path


def test_fuzz_byte_flips_and_truncations(tmp_path, tiny_artifact):
    """Seeded: 300 corrupted copies; each loads or raises an ArtifactError, nothing else."""
    raw = tiny_artifact.read_bytes()
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for case in range(300):
        data = bytearray(raw)
        if case % 2:
            data = data[: rng.randrange(0, len(raw))]
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        bad = tmp_path / "fuzz.h5"
        bad.write_bytes(bytes(data))
        try:
            posterior_fusion.load(bad)
            outcomes["ok"] += 1
        except ArtifactError as exc:
            assert str(exc).startswith(str(bad)), f"case {case}: message does not name the file: {exc}"
            outcomes["error"] += 1
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"case {case}: unexpected {type(exc).__name__}: {exc}")
    assert outcomes["error"] >= 150  # every truncation and most flips are detected


def poisoned_copy(src, dst, curvature_scale=1.0, map_noise=0.0):
    art = posterior_fusion.load(src)
    gen = torch.Generator().manual_seed(0)
    comps = []
    for c in art.components:
        blocks = []
        for b in c.curvature.blocks:
            if isinstance(b, Kron):
                blocks.append(Kron(b.B * curvature_scale, b.A))
            elif isinstance(b, Dense):
                blocks.append(Dense(b.G * curvature_scale))
            else:
                blocks.append(Diag(b.g * curvature_scale))
        w = c.map + map_noise * torch.randn(c.map.shape, generator=gen)
        comps.append(Component(c.index, w, BlockDiag(blocks), dict(c.training), c.temperature, c.prior_precision))
    write_client_artifact(dst, art.model_spec, art.layout, dict(art.metadata, poisoned=True), comps)
    return dst


@pytest.fixture(scope="module")
def honest(tmp_path_factory, small_silo):
    folder = tmp_path_factory.mktemp("honest")
    return folder, fit_split(folder, small_silo, 4, 75, "kron", mixtures=2, epochs=2)


def test_robust_screening_flags_scaled_curvature_and_far_maps(tmp_path, honest):
    _, paths = honest
    clients = [posterior_fusion.load(p) for p in paths]
    kept, rows = screen_clients(clients)
    assert len(kept) == 4 and not any(r["excluded"] for r in rows)

    scaled = poisoned_copy(paths[0], tmp_path / "scaled.h5", curvature_scale=1e6)
    far = poisoned_copy(paths[1], tmp_path / "far.h5", map_noise=5.0)
    clients = [posterior_fusion.load(p) for p in [scaled, far, *paths[2:]]]
    kept, rows = screen_clients(clients)
    assert [r["excluded"] for r in rows] == [True, True, False, False]
    assert "curvature" in rows[0]["reasons"][0] and "MAP distance" in rows[1]["reasons"][0]

    _, _, meta = fuse([scaled, *paths[1:]], "fedavg", robust=True)
    assert [p["file"] for p in meta["provenance"]] == [str(p) for p in paths[1:]]
    assert meta["screening"][0]["excluded"]
    with pytest.raises(ConfigError, match="at least 3"):
        fuse(paths[:2], "fedavg", robust=True)


def test_poisoned_curvature_dominates_fedbens_without_screening(tmp_path, honest):
    _, paths = honest
    scaled = poisoned_copy(paths[0], tmp_path / "scaled.h5", curvature_scale=1e6)
    opts = FusionOptions(progress=False)
    paper = {"steps": 40, "solver": "adam"}  # the paper's solver: the screening, not the solver, is under test
    with pytest.warns(UserWarning, match="solver=adam without validation data"):
        _, plain, _ = fuse([scaled, *paths[1:]], "fedbens", opts, paper)
        _, robust, _ = fuse([scaled, *paths[1:]], "fedbens", opts, paper, robust=True)
    victim = posterior_fusion.load(scaled).components[0].map
    # Without screening the poisoned client pins the first mode to its own MAP.
    assert (plain.members[0] - victim).norm() < 0.5 * (robust.members[0] - victim).norm()


def test_evidence_prior_stays_above_the_curvatures_float32_resolution(tmp_path, small_silo, monkeypatch):
    """A client whose curvature is 1e6× the others' (float32 storage: its rounding is ~1e-8 of its largest
    eigenvalue, far above a weak prior) used to make EM's summed precision indefinite under the evidence's
    prior (a LinAlgError from the default fusion without validation data, on these clients). Each λ0_j now stays ≥ RESOLUTION ×
    the block's largest summed curvature (an upper bound computed independently here from eigenvalues: dense ones,
    or a Kronecker factor pair's),
    and the default fusion runs."""
    import warnings

    from posterior_fusion.fusion.methods import fedbens as fedbens_module
    from posterior_fusion.fusion.methods.fedbens import RESOLUTION

    # the floor is applied to every round's λ0_j: three rounds of at most five EM iterations show it, on the
    # images at 7 × 7 (every fourth pixel: d = 970), where EM's solves are small
    monkeypatch.setattr(fedbens_module.evidence, "EVIDENCE_ROUNDS", 3)
    silo = SiloData(small_silo.x[:300, ::4, ::4].copy(), small_silo.y[:300], "fmnist", 10)
    paths = fit_split(tmp_path, silo, 4, 75, "kron", mixtures=2, epochs=2, kwargs={"in_features": 49, "hidden": 16})
    scaled = poisoned_copy(paths[0], tmp_path / "scaled.h5", curvature_scale=1e6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, res, meta = fuse([scaled, *paths[1:]], "fedbens", FusionOptions(progress=False), {"steps": 5})
    assert meta["resolved"]["server_prior"] == "evidence"
    clients = [posterior_fusion.load(p) for p in [scaled, *paths[1:]]]
    lam0 = meta["laplace"]["server_prior_precision"]

    def largest(block) -> float:  # of a PSD block; a Kronecker product's is the product of its factors' largest
        if isinstance(block, Kron):
            return float(torch.linalg.eigvalsh(block.B.double())[-1] * torch.linalg.eigvalsh(block.A.double())[-1])
        return float(torch.linalg.eigvalsh(block.to_dense().double())[-1])

    for j in range(len(lam0)):
        top = sum(sum(largest(comp.curvature.blocks[j]) for comp in c.components)
                  / (c.num_components * c.temperature) for c in clients)
        assert lam0[j] >= RESOLUTION * top * (1 - 1e-6) or meta["server_prior_search"]["block_scales"][j] == 0
    assert all(torch.isfinite(w).all() for w in res.members)


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


def test_global_artifact_refused_as_client(tmp_path, honest):
    _, paths = honest
    _, res, meta = fuse(paths, "fedavg")
    from posterior_fusion.artifact import write_global_artifact

    art = posterior_fusion.load(paths[0])
    write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, meta, res.members)
    shutil.copy(tmp_path / "g.h5", tmp_path / "g2.h5")
    with pytest.raises(ArtifactError, match="expected a client artifact"):
        fuse([paths[0], tmp_path / "g.h5"], "fedavg")
    with h5py.File(tmp_path / "g2.h5", "r") as f:
        assert f.attrs["artifact_kind"] == b"global"
