"""Compressed Kronecker factors with float16 eigenvectors (``compress_vectors = "float16"``): the
recorded error is the error of the stored (rounded, re-orthonormalised) form against an independent
dense float64 reference, the budget holds or the factor stays float32, the artifact round-trips and
fuses, and a float16 dataset anywhere else is refused in one line."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import scipy.linalg
import torch
from click.testing import CliRunner

import posterior_fusion
from cli.main import pfuse
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.artifact.blocks import ENCODINGS
from posterior_fusion.artifact.writer import text_attr
from posterior_fusion.curvature import BlockDiag, CompressedKron, Kron
from posterior_fusion.curvature.compressed import Compression
from posterior_fusion.curvature.truncation import (
    HALF_SHARE,
    ROUNDING_SHARE,
    joined,
    orthonormalise,
    rebuild,
    split_half,
    stored_error,
    truncate,
)
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component, frozen_mapping


def _psd(D: int, decay: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    return (Q * (decay ** torch.arange(D, dtype=torch.float64))) @ Q.T


def _reference_error(F: torch.Tensor, Ft: torch.Tensor, floor: float | None) -> float:
    """Frobenius: ‖F − F̃‖/‖F‖; precision: the largest |μ| of the generalised problem
    (F̃ − F) x = μ (F + f I) x (scipy, float64) — the bound on every quadratic form."""
    F, Ft = F.numpy(), Ft.numpy()
    if floor is None:
        return float(np.linalg.norm(F - Ft) / np.linalg.norm(F))
    mu = scipy.linalg.eigh(Ft - F, F + floor * np.eye(F.shape[0]), eigvals_only=True)
    return float(np.abs(mu).max())


def test_stored_error_is_truncates_error_for_the_factors_own_eigenvectors():
    """For F's own eigenvectors the dense error equals truncate's eigenvalue formula, both metrics."""
    F = _psd(30, 0.8, 0)
    for floor in (None, 0.01):
        U, lam, sigma, err = truncate(F, 0.05, floor)
        assert 0 < U.shape[1] < 30
        assert abs(stored_error(F, U, lam, sigma, floor) - err) < 1e-10
        assert abs(_reference_error(F, rebuild(U, lam, sigma, torch.float64), floor) - err) < 1e-9


def _ill(D: int, seed: int) -> torch.Tensor:
    """A PSD factor whose eigenvalues span eight decades (as trained K-FAC factors do)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    return (Q * torch.logspace(4, -4, D, dtype=torch.float64)) @ Q.T


def _spiky(D: int, seed: int) -> torch.Tensor:
    """A PSD factor with three dominant eigenvalues (1e4, 1e3, 1e2) above a tail spanning three decades."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    ev = torch.cat([torch.tensor([1e4, 1e3, 1e2], dtype=torch.float64), torch.logspace(0, -3, D - 3, dtype=torch.float64)])
    return (Q * ev) @ Q.T


@pytest.mark.parametrize("floor", [None, 0.1])
@pytest.mark.parametrize("budget", [0.05, 0.1])
def test_half_vectors_record_the_error_of_the_stored_form(floor, budget):
    """``from_kron(..., half=True)``: the trailing eigenvectors are float16 datasets, the leading ones
    float32; decoding them (the reader's path, shapes from the header) gives the in-memory block exactly;
    the recorded error per factor equals an independent dense float64 error of the decoded form (scipy's
    generalised eigenvalues for the precision metric) and is within the budget; quadratic forms respect it."""
    B, A = _ill(12, 1).float(), (_ill(60, 2) if floor is None else _spiky(60, 2)).float()
    block = Kron(B, A, scale=2.0)
    prior = None if floor is None else 2.0 * floor * float(torch.linalg.eigvalsh(B.double())[-1])  # A's floor
    c = CompressedKron.from_kron(block, budget, prior, half=True)
    assert c.half_counts[1] > 0
    tensors = c.to_tensors()
    assert tensors["lowrank_A_half_vectors"].dtype == torch.float16
    assert tensors["lowrank_A_vectors"].dtype == torch.float32
    enc = ENCODINGS["kron_lowrank"]
    header = enc.header(c)
    assert header["half"] == list(c.half_counts)
    shapes = enc.shapes(c.dim, header)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    read = enc.decode(tensors, header)
    torch.testing.assert_close(read.UA, c.UA, rtol=0, atol=0)
    torch.testing.assert_close(read.UB, c.UB, rtol=0, atol=0)
    top = {"B": float(torch.linalg.eigvalsh(A.double())[-1]), "A": float(torch.linalg.eigvalsh(B.double())[-1])}
    gen = torch.Generator().manual_seed(3)
    for side, err in zip("BA", c.errors):
        F = getattr(block, side).double()
        f = None if prior is None else prior / (2.0 * top[side])
        U, lam, sigma = getattr(read, f"U{side}").double(), getattr(read, f"l{side}").double(), getattr(read, f"s{side}")
        Ft = rebuild(U, lam, sigma, torch.float64)
        assert abs(_reference_error(F, Ft, f) - err) < 1e-6 * max(1.0, err), side
        assert err <= budget
        if f is not None:  # every quadratic form within the recorded error of F + f I's
            x = torch.randn(64, F.shape[0], generator=gen, dtype=torch.float64)
            d = torch.einsum("ki,ij,kj->k", x, Ft - F, x).abs()
            ref = torch.einsum("ki,ij,kj->k", x, F + f * torch.eye(F.shape[0], dtype=torch.float64), x)
            assert (d <= err * ref + 1e-9).all()


def test_split_keeps_the_fewest_leading_vectors_in_float32():
    """Precision metric, a factor with dominant eigenvalues: rounding every kept eigenvector misses the
    budget (the largest eigenvalues leak into the small directions); the split keeps k ≥ 1 leading vectors
    float32, its stored error is within the budget and its rounding alone (against the float32 form)
    within ``ROUNDING_SHARE`` of it, and k − 1 would break one of the two."""
    F = _spiky(80, 5)
    budget, floor = 0.05, 0.1
    lead, tail, lam, sigma, err = split_half(F, budget, floor)
    k = lead.shape[1]
    U = torch.cat([lead, tail.double()], 1)
    all_half = stored_error(F, orthonormalise(U.half()), lam, sigma, floor)
    assert all_half > budget and 1 <= k < U.shape[1] and err <= budget
    stored = joined(lead, tail).to(F.dtype)
    assert abs(stored_error(F, stored, lam, sigma, floor) - err) < 1e-12
    rounding = stored_error(F, stored, lam, sigma, floor, reference=U)
    assert rounding <= ROUNDING_SHARE * budget
    fewer = joined(U[:, : k - 1], U[:, k - 1 :].half()).to(F.dtype)
    assert (stored_error(F, fewer, lam, sigma, floor) > budget
            or stored_error(F, fewer, lam, sigma, floor, reference=U) > ROUNDING_SHARE * budget)
    assert truncate(F, HALF_SHARE * budget, floor)[0].shape[1] == U.shape[1]  # the truncation took HALF_SHARE
    # the rounding's cost, densely: the whitened difference of the two rebuilt forms (float64 eigh)
    lamF, Q = torch.linalg.eigh(F)
    Wq = Q * (lamF.clamp(min=0) + floor).rsqrt()
    M = Wq.T @ (rebuild(stored, lam, sigma, torch.float64) - rebuild(U, lam, sigma, torch.float64)) @ Wq
    assert abs(torch.linalg.eigvalsh(0.5 * (M + M.T)).abs().max().item() - rounding) < 1e-9


def test_a_factor_whose_rounded_form_misses_the_budget_stays_float32():
    """A budget below float16's rounding: no factor is stored in half precision."""
    F = _psd(40, 0.9, 4).float()
    c = CompressedKron.from_kron(Kron(F[:10, :10] @ F[:10, :10].T + torch.eye(10), F), 1e-6, None, half=True)
    assert c.stored == (None, None) and c.half_counts == (0, 0)
    assert all(t.dtype == torch.float32 for t in c.to_tensors().values())


def test_orthonormalise_is_the_nearest_orthonormal_basis():
    """Löwdin's ``U (UᵀU)^{-1/2}`` equals the polar factor of U (scipy) and is orthonormal."""
    U = torch.linalg.qr(torch.randn(50, 7, dtype=torch.float64))[0].half()
    Uo = orthonormalise(U)
    torch.testing.assert_close(Uo.T @ Uo, torch.eye(7, dtype=torch.float64), rtol=0, atol=1e-12)
    polar, _ = scipy.linalg.polar(U.double().numpy())
    np.testing.assert_allclose(Uo.numpy(), polar, atol=1e-12)


def _component(seed: int, d_out: int = 8, d_in: int = 40):
    spec = ModelSpec("mlp", {"in_features": d_in, "num_classes": d_out, "hidden_sizes": [], "bias": False})
    layout = ParameterLayout.from_model(spec.build())
    B, A = _psd(d_out, 0.5, seed).float(), _ill(d_in, seed + 10).float()
    g = torch.Generator().manual_seed(seed)
    comp = Component(0, torch.randn(d_out * d_in, generator=g), BlockDiag([Kron(B, A)]), frozen_mapping({"seed": 0}),
                     0.1, 10.0)
    meta = {"n_data": 10, "class_counts": [1] * 7 + [3], "temperature": 0.1, "prior_precision": 10.0, "structure": "kron"}
    return spec, layout, comp, meta


def test_half_artifacts_round_trip_shrink_and_fuse(tmp_path):
    """Written with float16 vectors: the datasets are float16, the metadata says so, the file is
    smaller than with float32 vectors, the read block is the writer's, and fuse runs on it."""
    spec, layout, comp, meta = _component(0)
    paths = {}
    for vectors in ("float32", "float16"):
        paths[vectors] = tmp_path / f"{vectors}.h5"
        write_client_artifact(paths[vectors], spec, layout, meta, [comp], Compression(0.05, "precision", vectors))
    with h5py.File(paths["float16"]) as f:
        assert f["components/0/curvature/0/lowrank_A_half_vectors"].dtype == np.float16
        assert f["components/0/curvature/0/lowrank_A_vectors"].dtype == np.float32
        assert json.loads(f.attrs["metadata"])["compress_vectors"] == "float16"
    from conftest import SCHEMA, check

    with h5py.File(paths["float16"]) as f:  # the header as the published schema describes it
        check(json.loads(f["components/0/curvature"].attrs["blocks"]), SCHEMA["properties"]["blocks"])
    with h5py.File(paths["float32"]) as f:
        assert "compress_vectors" not in json.loads(f.attrs["metadata"])
    assert paths["float16"].stat().st_size < paths["float32"].stat().st_size
    shown = CliRunner().invoke(pfuse, ["inspect", str(paths["float16"]), "--validate"])
    assert shown.exit_code == 0 and "compressed: budget 0.05 (precision), eigenvectors float16" in shown.output
    from posterior_fusion.artifact.reader import declared_bytes

    loaded = declared_bytes(paths["float16"])["data_bytes"]  # float16 datasets count as the float32 they load as
    with h5py.File(paths["float16"]) as f:
        data = (f["components/0/map"], *f["components/0/curvature/0"].values())
        on_disk = sum(d.size * d.dtype.itemsize for d in data)
        halves = sum(d.size for d in data if d.dtype == np.float16)
        assert halves > 0 and loaded == on_disk + 2 * halves
    art = posterior_fusion.load(paths["float16"])
    blk = art.components[0].curvature.blocks[0]
    assert isinstance(blk, CompressedKron) and blk.half_counts[1] > 0
    want = CompressedKron.from_kron(comp.curvature.blocks[0], 0.05, 10.0 * 0.1, half=True)
    torch.testing.assert_close(blk.UA, want.UA, rtol=0, atol=0)
    assert list(blk.errors) == pytest.approx(list(want.errors), rel=1e-12)
    other = tmp_path / "other.h5"
    _, _, comp2, _ = _component(1)
    write_client_artifact(other, spec, layout, meta, [comp2], Compression(0.05, "precision", "float16"))
    r = CliRunner().invoke(pfuse, ["fuse", str(paths["float16"]), str(other), "--method", "fedbens", "--set", "steps=3",
                                   "--out", str(tmp_path / "g.h5")])
    assert r.exit_code == 0, r.stderr


@pytest.mark.parametrize("dataset,dtype", [("lowrank_A_values", np.float16), ("map", np.float16),
                                           ("lowrank_A_half_vectors", np.float32)])
def test_float16_elsewhere_is_refused_in_one_line(tmp_path, dataset, dtype):
    """Only the half datasets hold float16, and only float16: anything else is one line, exit 2."""
    spec, layout, comp, meta = _component(0)
    path = tmp_path / "c.h5"
    write_client_artifact(path, spec, layout, meta, [comp], Compression(0.05, "frobenius", "float16"))
    where = "components/0/map" if dataset == "map" else f"components/0/curvature/0/{dataset}"
    with h5py.File(path, "r+") as f:
        data = f[where][...]
        del f[where]
        f.create_dataset(where, data=data.astype(dtype))
    r = CliRunner().invoke(pfuse, ["inspect", str(path), "--validate"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "dtype" in r.stderr and dataset in r.stderr, r.stderr


def test_a_half_count_beyond_the_rank_is_refused_in_one_line(tmp_path):
    spec, layout, comp, meta = _component(0)
    path = tmp_path / "c.h5"
    write_client_artifact(path, spec, layout, meta, [comp], Compression(0.05, "precision", "float16"))
    with h5py.File(path, "r+") as f:
        grp = f["components/0/curvature"]
        blocks = json.loads(grp.attrs["blocks"])
        blocks[0]["half"] = [0, blocks[0]["rank"][1] + 1]
        grp.attrs["blocks"] = text_attr(json.dumps(blocks))
    r = CliRunner().invoke(pfuse, ["inspect", str(path), "--validate"])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "half" in r.stderr, r.stderr


def test_compress_vectors_is_a_fit_setting():
    """``compress_vectors`` is validated, enters the fingerprint only when it changes what is written."""
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.local.fit_config import FitConfig

    assert "compress_vectors" not in FitConfig(compress=0.05).fingerprint_dict()
    assert "compress_vectors" not in FitConfig(compress_vectors="float16").fingerprint_dict()  # plain: no effect
    assert FitConfig(compress=0.05, compress_vectors="float16").fingerprint_dict()["compress_vectors"] == "float16"
    assert FitConfig(compress=0.05, compress_vectors="float16").compression.half
    with pytest.raises(ConfigError, match="compress_vectors"):
        FitConfig(compress=0.05, compress_vectors="bfloat16").validate()
