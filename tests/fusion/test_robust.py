"""Robust screening of the clients: attackers excluded, honest clients kept, poisoned curvature found."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fit_artifact, fit_split, poisoned_copy

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import (
    ConfigError,
)
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.fusion.robust import screen_clients
from posterior_fusion.posterior import Component


def attacked(src, dst, scale=1.0, flip=False, meta=None):
    art = posterior_fusion.load(src)
    comps = []
    for c in art.components:
        blocks = [Kron(b.B * scale, b.A) if isinstance(b, Kron) else Dense(b.G * scale) if isinstance(b, Dense)
                  else Diag(b.g * scale) for b in c.curvature.blocks]
        comps.append(Component(c.index, -c.map if flip else c.map, BlockDiag(blocks), dict(c.training),
                               c.temperature, c.prior_precision))
    write_client_artifact(dst, art.model_spec, art.layout, dict(art.metadata, **(meta or {})), comps)
    return dst


@pytest.fixture(scope="module")
def screening_clients(tmp_path_factory, fmnist_train):
    x, y = fmnist_train
    folder = tmp_path_factory.mktemp("screen")
    silo = SiloData(x[:1000], y[:1000], "fmnist", 10)
    honest = fit_split(folder, silo, 5, 200, "kron", name="honest", mixtures=2, epochs=3)
    flipped = SiloData(x[1000:1200], (9 - y[1000:1200]).astype(np.int64), "fmnist", 10)
    fit_artifact(folder / "labelflip.h5", flipped, "kron", mixtures=2, epochs=3, seed=9)
    val = SiloData(x[2000:2500], y[2000:2500], "fmnist", 10)
    return folder, honest, val


ATTACKS = {
    "curvature_x10": lambda src, dst, n: attacked(src, dst, scale=10.0),
    "curvature_x100": lambda src, dst, n: attacked(src, dst, scale=100.0),
    "tiny_T": lambda src, dst, n: attacked(src, dst, meta={"temperature": 1e-4}),
    "huge_n_data": lambda src, dst, n: attacked(src, dst, meta={"n_data": n * 10**5,
                                                                 "class_counts": [n * 10**5] + [0] * 9}),
    "sign_flip": lambda src, dst, n: attacked(src, dst, flip=True),
    "duplicate_one_byte": lambda src, dst, n: attacked(src, dst, meta={"note": "resubmitted"}),
}


@pytest.mark.parametrize("C", [3, 5])
@pytest.mark.parametrize("attack", sorted(ATTACKS) + ["label_flip"])
def test_screening_excludes_each_attacker_and_no_honest_client(tmp_path, screening_clients, attack, C):
    folder, honest, val = screening_clients
    others = honest[: C - 1]
    if attack == "label_flip":
        bad = folder / "labelflip.h5"
    else:  # a duplicate copies a participating client; the other attacks start from a client left out
        src = honest[0] if attack == "duplicate_one_byte" else honest[4]
        bad = ATTACKS[attack](src, tmp_path / f"{attack}.h5", posterior_fusion.load(src).n_data)
    clients = [posterior_fusion.load(p) for p in [*others, bad]]
    kept, rows = screen_clients(clients, val=val)
    assert [r["excluded"] for r in rows] == [False] * (C - 1) + [True], rows
    assert {c.path for c in kept} == {str(p) for p in others}


def test_screening_keeps_all_honest_clients(screening_clients):
    _, honest, val = screening_clients
    for C in (3, 5):
        kept, rows = screen_clients([posterior_fusion.load(p) for p in honest[:C]], val=val)
        assert len(kept) == C, rows


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
