"""Every precision structure against a dense float64 reference."""

from __future__ import annotations

import pytest
import torch
from conftest import random_psd

from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron

T, LAM = 0.1, 10.0


def make(kind: str, gen: torch.Generator):
    if kind == "diag":
        return Diag(torch.rand(7, generator=gen, dtype=torch.float64) * 3)
    if kind == "dense":
        return Dense(random_psd(6, gen, rank=3))
    if kind == "kron":
        return Kron(random_psd(3, gen), random_psd(4, gen, rank=2))
    return BlockDiag([make("diag", gen), make("kron", gen), make("dense", gen)])


KINDS = ["diag", "dense", "kron", "blockdiag"]


def raw_dense(struct) -> torch.Tensor:
    """Dense raw curvature G built independently from the stored tensors."""
    if isinstance(struct, Diag):
        return torch.diag(struct.g)
    if isinstance(struct, Dense):
        return struct.G
    if isinstance(struct, Kron):
        B, A = struct.B, struct.A
        out, inn = B.shape[0], A.shape[0]
        # Entry ((i,j),(k,l)) of B ⊗ A with row-major vec is B[i,k] * A[j,l].
        return torch.einsum("ik,jl->ijkl", B, A).reshape(out * inn, out * inn)
    return torch.block_diag(*[raw_dense(b) for b in struct.blocks])


def dense_reference(struct) -> torch.Tensor:
    """Λ = G/T + λ0 I."""
    G = raw_dense(struct)
    return G / T + LAM * torch.eye(G.shape[0], dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_against_dense_float64(kind):
    gen = torch.Generator().manual_seed(1)
    raw = make(kind, gen)
    prec = raw.precision(T, LAM)
    ref = dense_reference(raw)
    v = torch.randn(5, prec.dim, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(prec.to_dense(), ref)
    torch.testing.assert_close(prec.quadratic_form(v), torch.einsum("bi,ij,bj->b", v, ref, v))
    torch.testing.assert_close(prec.matvec(v), v @ ref)
    torch.testing.assert_close(prec.logdet(), torch.logdet(ref))
    torch.testing.assert_close(prec.diagonal(), torch.diagonal(ref))


@pytest.mark.parametrize("kind", KINDS + ["lowrank"])
def test_spectrum_is_the_dense_eigenvalues_without_the_shift(kind):
    """``spectrum()`` of the precision ``G/T + λ0 I``: the eigenvalues of ``G/T`` (dense float64
    eigvalsh), factored for Kronecker blocks (``b_i a_j``)."""
    from posterior_fusion.curvature import CompressedKron

    gen = torch.Generator().manual_seed(4)
    raw = CompressedKron.from_kron(make("kron", gen), 0.05) if kind == "lowrank" else make(kind, gen)
    prec = raw.precision(T, LAM)
    b, a = prec.spectrum()
    assert b.dtype == torch.float64 and (a is None) == (kind not in ("kron", "lowrank"))
    got = torch.sort((b if a is None else torch.outer(b, a)).reshape(-1)).values
    want = torch.linalg.eigvalsh(prec.to_dense().double() - LAM * torch.eye(prec.dim, dtype=torch.float64))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_covariance_is_inverse_precision(kind):
    gen = torch.Generator().manual_seed(2)
    # Smaller shift so the covariance is far from isotropic and the test can fail.
    prec = make(kind, gen).precision(0.5, 0.3)
    ref_cov = torch.linalg.inv(prec.to_dense())
    n = 200_000
    samples = prec.sample(n, generator=torch.Generator().manual_seed(3))
    assert samples.shape == (n, prec.dim)
    emp = samples.T @ samples / n
    err = (emp - ref_cov).abs().max() / ref_cov.abs().max()
    assert err < 0.03, f"relative covariance error {err:.4f}"


def test_raw_curvature_is_not_tempered():
    gen = torch.Generator().manual_seed(4)
    k = make("kron", gen)
    assert k.scale == 1.0 and k.shift == 0.0
    torch.testing.assert_close(k.to_dense(), torch.kron(k.B, k.A))
    torch.testing.assert_close(k.precision(2.0, 3.0).to_dense(), torch.kron(k.B, k.A) / 2.0 + 3.0 * torch.eye(k.dim, dtype=torch.float64))


def test_invalid_temperature_is_a_typed_error():
    from posterior_fusion.errors import ConfigError

    with pytest.raises(ConfigError):
        Diag(torch.ones(3)).precision(0.0, 1.0)
    with pytest.raises(ConfigError):
        Diag(torch.ones(3)).quadratic_form(torch.ones(4))
