"""Modes that coincide merged into one member (fusion/methods/fedbens/merging.py)."""

from __future__ import annotations

import dataclasses
import json

import torch
from click.testing import CliRunner

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionInputs,
    FusionOptions,
)
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


def test_coinciding_rows_groups_by_key_within_a_relative_distance():
    """Rows are one mode when they share a key (the objective they were optimised against) and lie within the
    tolerance of the group's first row, relative to the larger norm; a row joins the first group it fits."""
    from posterior_fusion.fusion.methods.fedbens import coinciding_rows

    base = torch.tensor([[100.0, 0.0], [0.0, 100.0]], dtype=torch.float64)
    W = torch.stack([base[0], base[1], base[0] + torch.tensor([5e-4, 0.0], dtype=torch.float64),  # 5e-6 relative
                     base[0] + torch.tensor([0.0, 2e-3], dtype=torch.float64),                 # 2e-5: apart
                     base[1], base[0]])
    assert coinciding_rows(W, [0, 0, 0, 0, 0, 0], 1e-5) == [[0, 2, 5], [1, 4], [3]]
    assert coinciding_rows(W, [0, 0, 0, 0, 0, 1], 1e-5) == [[0, 2], [1, 4], [3], [5]]  # another key: another mode
    assert coinciding_rows(W, [0] * 6, 0.0) == [[0, 5], [1, 4], [2], [3]]  # exact copies still coincide at 0
    assert coinciding_rows(W, [0] * 6, 1e-4) == [[0, 2, 3, 5], [1, 4]]


def test_starts_that_end_on_one_mode_are_one_member_weighted_by_their_share(fitted, monkeypatch):
    """EM's stationary point does not depend on where it starts, only on the prior centre (the component index):
    with `starts=median+clients` and `modes=1` the 1 + 3·2 rows end on two modes, from 4 and 3 starts. Each is one
    member weighted by its starts' share (4/7, 3/7), with the row's curvature; the map and glm predictives equal
    those of the unmerged rows (MERGE_TOLERANCE = 0: every row a member, uniform weights)."""
    from posterior_fusion.data.silo import read_silo
    from posterior_fusion.fusion.methods import fedbens as fedbens_module
    from posterior_fusion.predictive import predict

    folder, paths = fitted
    clients = [posterior_fusion.load(p) for p in paths]
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    settings = FedBEnsSettings(solver="em", starts="median+clients", modes=1, prior_centre="clients",
                               server_prior="clients", steps=50)
    merged = fedbens(inputs, settings)
    plain = fedbens(inputs, dataclasses.replace(settings, laplace=False))  # without the Laplace step: the same members
    assert plain.info["members_from_starts"] == merged.info["members_from_starts"]
    torch.testing.assert_close(plain.mode_weights, merged.mode_weights)
    # Laplace weights: a mode keeps its rows' mass. Here they are one-hot (modes far apart in the objective), so the
    # check flattens them — the same softmax of the objective per mode, at the distinct modes' own spread
    values = merged.info["laplace"]["objective_at_modes"]
    spread = abs(values[0] - values[1]) or 1.0
    monkeypatch.setattr(fedbens_module, "laplace_mode_weights",
                        lambda v, precisions: torch.softmax(-(v.double() - v.double().min()) / spread, 0))
    by_mass = fedbens(inputs, dataclasses.replace(settings, mode_weights="laplace"))
    assert float(by_mass.mode_weights.min()) > 0.05
    monkeypatch.setattr(fedbens_module.merging, "MERGE_TOLERANCE", 0.0)
    rows = fedbens(inputs, settings)
    rows_by_mass = fedbens(inputs, dataclasses.replace(settings, mode_weights="laplace"))
    for k, group in enumerate(merged.info["members_from_starts"]):
        torch.testing.assert_close(by_mass.mode_weights[k], rows_by_mass.mode_weights[group].sum())
    # row 0: the median of component 0; rows 1..6: client-major, component m = (row - 1) % 2
    assert merged.info["members_from_starts"] == [[0, 1, 3, 5], [2, 4, 6]]
    assert len(rows.members) == 7 and "members_from_starts" not in rows.info
    torch.testing.assert_close(merged.mode_weights, torch.tensor([4 / 7, 3 / 7], dtype=torch.float64))
    for member, group in zip(merged.members, merged.info["members_from_starts"]):
        for r in group:
            torch.testing.assert_close(member, rows.members[r], rtol=1e-5, atol=1e-6)
    lam = merged.info["laplace"]["prior_precision"]
    x, _ = read_silo(folder / "val.h5").tensors()
    for predictive in ("map", "glm"):
        got = predict(inputs.spec, merged.members, x, predictive, [c.precision(1.0, lam) for c in merged.curvatures],
                      merged.mode_weights)
        want = predict(inputs.spec, rows.members, x, predictive, [c.precision(1.0, lam) for c in rows.curvatures],
                       rows.mode_weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fuse_says_when_starts_merged_and_the_artifact_keeps_their_weights(fitted, tmp_path):
    """`pfuse fuse` says how many starts reached how many modes, labels the history by start, and the global
    artifact carries the members' weights and their starts (read back through the artifact's validation)."""
    folder, paths = fitted
    out = tmp_path / "g.h5"
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedbens", "--out", str(out),
                                   "--set", "solver=em", "--set", "starts=median+clients", "--set", "modes=1",
                                   "--set", "server_prior=clients", "--set", "laplace=false"])
    assert r.exit_code == 0, r.output
    assert "7 starts reached 2 distinct modes" in r.output and "start 6: best step" in r.output
    g = posterior_fusion.load(out)
    assert len(g.members) == 2 and g.metadata["members_from_starts"] == [[0, 1, 3, 5], [2, 4, 6]]
    torch.testing.assert_close(g.mode_weights, torch.tensor([4 / 7, 3 / 7], dtype=torch.float64))
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedbens", "--out", str(tmp_path / "j.h5"),
                                   "--set", "solver=em", "--set", "starts=median+clients", "--set", "modes=1",
                                   "--set", "server_prior=clients", "--set", "laplace=false", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["members"] == 2 and got["members_from_starts"] == [[0, 1, 3, 5], [2, 4, 6]]
