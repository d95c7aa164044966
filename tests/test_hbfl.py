"""HBFL's aggregation (paper 003, eqs. 3.8–3.12) against a hand-written dense float64 solve with
the q_k = n_k / n weights and no global prior."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_artifact

import posterior_fusion
from posterior_fusion.data.silo import SiloData
from posterior_fusion.fusion import FusionInputs, FusionOptions
from posterior_fusion.fusion.hbfl import HBFLSettings, hbfl


def _clients(tmp_path, silo, structure, sizes=(60, 100, 140)):
    paths = []
    start = 0
    for c, n in enumerate(sizes):  # unequal sizes: the q_k weights matter
        part = SiloData(silo.x[start : start + n], silo.y[start : start + n], "fmnist", 10)
        start += n
        paths.append(tmp_path / f"c{c}.h5")
        fit_artifact(paths[-1], part, structure, model="mlp", kwargs={"hidden": 8, "bias": True}, mixtures=1,
                     epochs=1, seed=c)
    return [posterior_fusion.load(p) for p in paths]


def _dense_problem(clients):
    """Λ = Σ q_k G_k / T_k and b = Σ q_k G_k / T_k ŵ_k, float64 dense; q_k = n_k / n."""
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    q = n / n.sum()
    Lam = sum(qk / c.components[0].temperature * c.components[0].curvature.to_dense().double()
              for qk, c in zip(q, clients))
    rhs = sum(qk / c.components[0].temperature * c.components[0].curvature.to_dense().double()
              @ c.components[0].map.double() for qk, c in zip(q, clients))
    avg = sum(qk * c.components[0].map.double() for qk, c in zip(q, clients))
    return Lam, rhs, avg


@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_hbfl_closed_form_equals_dense_solve(tmp_path, small_silo, structure):
    clients = _clients(tmp_path, small_silo, structure)
    settings = HBFLSettings(damping=1e-6)
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)), settings).members[0].double()
    Lam, rhs, avg = _dense_problem(clients)
    # the damping, block by block as documented: ε_j = damping · mean(diag Λ_jj), pulling to FedAvg
    eps = torch.zeros(Lam.shape[0], dtype=torch.float64)
    ref_blocks = clients[0].components[0].curvature
    for off, b in zip(ref_blocks.offsets, ref_blocks.blocks):
        sl = slice(off, off + b.dim)
        eps[sl] = settings.damping * Lam.diagonal()[sl].mean()
    want = torch.linalg.solve(Lam + torch.diag(eps), rhs + eps * avg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    # the match is far tighter than the distance to FedAvg (the test would be empty otherwise)
    assert (got - avg).abs().max() > 20 * (got - want).abs().max()


def test_hbfl_kron_reaches_the_dense_optimum(tmp_path, small_silo):
    clients = _clients(tmp_path, small_silo, "kron")
    settings = HBFLSettings(steps=6000, adam_lr=2e-2, clip=1e6)
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)), settings).members[0].double()
    Lam, rhs, avg = _dense_problem(clients)

    def f(w):  # ½ Σ q_k (w − ŵ_k)ᵀ Λ_k (w − ŵ_k) up to a constant
        return 0.5 * w @ Lam @ w - rhs @ w

    eps = 1e-9 * Lam.diagonal().mean()
    best = torch.linalg.solve(Lam + eps * torch.eye(len(rhs), dtype=torch.float64), rhs + eps * avg)
    gap, scale = f(got) - f(best), f(avg) - f(best)
    assert scale > 0 and gap <= 1e-3 * scale, (gap, scale)
