"""FedBEns' evidence: its prior stays above the curvatures' float32 resolution."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from click.testing import CliRunner
from conftest import TINY_LAYOUT, fit_split, poisoned_copy, structured_clients

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import Kron
from posterior_fusion.data.silo import SiloData
from posterior_fusion.fusion import (
    METHODS,  # noqa: E402
    FusionInputs,
    FusionOptions,
    fuse,
)
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings

fedavg, fisher_merge, product, regmean, fedbens = (METHODS[m] for m in ("fedavg", "fisher-merge", "product", "regmean", "fedbens"))


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


def _dense_log_evidence(one, T: float, lam_blocks: list[float], centre: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Exact ``log Z`` (up to a constant) of the server's model when each client is one Gaussian, and the
    posterior mode: ``Z = ∫ Π_c (q_c / p0_c)(w) N(w; μ, Λ0⁻¹) dw`` with ``p0_c = N(μ, λ_c⁻¹ I)`` and
    ``Λ0 = blockdiag(λ0_j I)``, from dense float64 matrices (the integrand is Gaussian:
    ``−½ Q_min − ½ log|H + Λ0| + ½ log|Λ0|``)."""
    d = TINY_LAYOUT.dim
    eye = torch.eye(d, dtype=torch.float64)
    lams = [c.prior_precision for c in one]
    Ls = [torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks]) / T + lam * eye
          for c, lam in zip(one, lams)]
    maps = [c.components[0].map for c in one]
    L0 = torch.cat([torch.full((b.dim,), v, dtype=torch.float64)
                    for b, v in zip(one[0].components[0].curvature.blocks, lam_blocks)])
    E = sum(lams) * eye - torch.diag(L0)  # the over-counted prior, per coordinate
    H = sum(Ls) - E
    w = torch.linalg.solve(H, sum(L @ m for L, m in zip(Ls, maps)) - E @ centre)
    Q = sum((w - m) @ L @ (w - m) for L, m in zip(Ls, maps)) - (w - centre) @ E @ (w - centre)
    return float(-0.5 * Q - 0.5 * torch.linalg.slogdet(H)[1] + 0.5 * torch.log(L0).sum()), w


@pytest.mark.parametrize("centre", ["prior", "clients", "base"])
@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_server_prior_evidence_maximises_the_exact_evidence_of_a_gaussian_product(structure, centre):
    """fedbens `server_prior=evidence` with one component per client: the product is Gaussian, so its
    Laplace evidence is the exact marginal likelihood of the server's prior, here one precision per block
    ``ρ c_j`` with ``c_j`` the block's mean diagonal of ``Σ_c G_c / T`` (from the dense matrices); the ρ
    found is the maximiser of the dense float64 log Z (golden section over log ρ, independent of the
    library's MacKay rounds), the mode is the dense minimiser there, and the search is recorded. (diag:
    one block; diag+full: a diagonal and a dense block. The temperature makes the clients' curvature large
    against their disagreement, for an interior maximum; otherwise the evidence prefers every client at
    the centre.)"""
    T = 0.02
    one = structured_clients(structure, C=3, M=1, seed=5)
    d = TINY_LAYOUT.dim
    mu = (torch.zeros(d, dtype=torch.float64) if centre == "prior"
          else torch.stack([c.components[0].map for c in one]).mean(0))  # equal λ_c: the plain average
    if centre == "base":  # clients fine-tuned from a base: every prior N(base, ·), divided out there
        mu = mu + 0.5 * torch.randn(d, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        one, centre = [dataclasses.replace(c, prior_mean=mu) for c in one], "prior"
    G = sum(torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks]) / T for c in one)
    offs = one[0].components[0].curvature.offsets
    c = [float(torch.diagonal(G)[o: o + b.dim].mean()) for o, b in zip(offs, one[0].components[0].curvature.blocks)]
    lo, hi, g = math.log(1e-8), math.log(1e4), (math.sqrt(5) - 1) / 2
    f = lambda t: _dense_log_evidence(one, T, [math.exp(t) * cj for cj in c], mu)[0]  # noqa: E731
    grid = [lo + i * (hi - lo) / 400 for i in range(401)]
    best = max(range(401), key=lambda i: f(grid[i]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, 400)]
    while hi - lo > 1e-9:
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (a, hi) if f(a) < f(b) else (lo, b)
    rho_ref = math.exp(0.5 * (lo + hi))
    assert 1e-7 < rho_ref < 1e3  # an interior maximum: the test can tell a wrong ρ from a right one
    res = fedbens(FusionInputs(one, FusionOptions(temperature=T, progress=False)),
                  FedBEnsSettings(solver="em", prior_centre=centre, server_prior="evidence", steps=20))
    lam = res.info["laplace"]["server_prior_precision"]
    search = res.info["server_prior_search"]
    f64 = dict(dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(search["block_scales"], **f64), torch.tensor(c, **f64), rtol=1e-10, atol=0)
    rho = lam[0] / c[0]
    assert abs(math.log(rho / rho_ref)) < 0.03, (rho, rho_ref)
    torch.testing.assert_close(torch.tensor(lam, **f64), rho * torch.tensor(c, **f64), rtol=1e-12, atol=0)
    assert res.info["laplace"]["server_prior"] == "evidence" and res.info["laplace"]["prior_precision"] == lam
    assert search["converged"] and len(search["rounds"]) >= 2  # MacKay rounds, from the clients' λ0
    torch.testing.assert_close(res.members[0].double(), _dense_log_evidence(one, T, lam, mu)[1], rtol=1e-5, atol=1e-5)
    assert f(math.log(rho)) > max(f(math.log(rho) + 0.3), f(math.log(rho) - 0.3))
    # the objective recorded at the mode: −log of the dense posterior with the per-block prior N(μ, Λ0⁻¹)
    w = res.members[0].double()
    L0 = torch.cat([torch.full((b.dim,), v, dtype=torch.float64) for b, v in zip(one[0].components[0].curvature.blocks, lam)])
    MVN = torch.distributions.MultivariateNormal
    eye = torch.eye(d, dtype=torch.float64)
    logp = MVN(mu, precision_matrix=torch.diag(L0)).log_prob(w)
    for c in one:
        G = torch.block_diag(*[b.to_dense() for b in c.components[0].curvature.blocks])
        logp = logp + MVN(c.components[0].map, precision_matrix=G / T + c.prior_precision * eye).log_prob(w)
        logp = logp - MVN(mu, precision_matrix=c.prior_precision * eye).log_prob(w)
    assert res.info["laplace"]["objective_at_modes"][0] == pytest.approx(float(-logp), rel=1e-8, abs=1e-6)


def test_server_prior_evidence_without_an_interior_maximum_stops_at_the_range_and_says_so():
    """Clients whose MAPs agree within their posterior widths (T = 50 here: wide posteriors): the evidence grows
    without bound as the modes approach the prior centre; ρ stops at the end of its search range (and never
    lets a λ0_j leave the artifacts' prior-precision range, so the global artifact stays readable), a
    warning says so, the record says `at_bound`, and the mode is the clients' average."""
    one = structured_clients("diag+full", C=3, M=1, seed=5)
    with pytest.warns(UserWarning, match="upper bound"):
        res = fedbens(FusionInputs(one, FusionOptions(temperature=50.0, progress=False)),
                      FedBEnsSettings(solver="em", prior_centre="clients", server_prior="evidence", steps=20))
    lam = res.info["laplace"]["server_prior_precision"]
    assert max(lam) <= 1e8 and res.info["server_prior_search"]["at_bound"]
    mean = torch.stack([c.components[0].map for c in one]).mean(0)
    torch.testing.assert_close(res.members[0].double(), mean, rtol=1e-5, atol=1e-5)


def test_server_prior_evidence_says_when_the_clients_agree_and_stops_climbing():
    """Three clients with the same MAPs and curvature agree exactly: the evidence has no interior maximum
    (ρ rises by a steady factor every round). The search stops climbing after a few rounds, solves at the
    upper bound, records `no_interior_maximum` and says in one warning that the clients agree and the mode is
    their average; the mode is that average (the clients' common MAP)."""
    from posterior_fusion.fusion.methods.fedbens.evidence import CLIMB_ROUNDS

    one = structured_clients("diag+full", C=1, M=1, seed=5)[0]
    same = [one, one, one]
    with pytest.warns(UserWarning) as caught:
        res = fedbens(FusionInputs(same, FusionOptions(temperature=0.1, progress=False)),
                      FedBEnsSettings(solver="em", prior_centre="clients", server_prior="evidence", steps=20))
    text = " ".join(str(w.message) for w in caught)
    assert "no interior maximum" in text and "clients agree" in text and "average" in text
    search = res.info["server_prior_search"]
    assert search["no_interior_maximum"] and search["at_bound"] and search["converged"]
    assert len(search["rounds"]) <= CLIMB_ROUNDS + 2
    torch.testing.assert_close(res.members[0].double(), one.components[0].map.double(), rtol=1e-5, atol=1e-5)


def test_server_prior_evidence_out_of_rounds_keeps_modes_and_prior_that_belong_together(monkeypatch):
    """Stopped by the round limit before ρ settles: a warning says so, and the λ0_j returned are the ones the
    returned modes were solved at (the dense minimiser there), not the next round's."""
    from posterior_fusion.fusion.methods import fedbens as fedbens_module

    monkeypatch.setattr(fedbens_module.evidence, "EVIDENCE_ROUNDS", 2)
    T = 0.02
    one = structured_clients("diag+full", C=3, M=1, seed=5)
    mu = torch.stack([c.components[0].map for c in one]).mean(0)
    with pytest.warns(UserWarning, match="still moved after 2 rounds"):
        res = fedbens(FusionInputs(one, FusionOptions(temperature=T, progress=False)),
                      FedBEnsSettings(solver="em", prior_centre="clients", server_prior="evidence", steps=20))
    lam = res.info["laplace"]["server_prior_precision"]
    rounds = res.info["server_prior_search"]["rounds"]
    assert len(rounds) == 2 and not res.info["server_prior_search"]["converged"]
    assert lam[0] / res.info["server_prior_search"]["block_scales"][0] == pytest.approx(rounds[-1]["scale"])
    torch.testing.assert_close(res.members[0].double(), _dense_log_evidence(one, T, lam, mu)[1], rtol=1e-5, atol=1e-5)


def test_server_prior_evidence_global_artifact_round_trip(tmp_path, fitted):
    """Real kron artifacts fused with `server_prior=evidence` (prior centre clients): one λ0 per block is
    written, read back and used by every predictive (each block's Laplace precision carries its own
    prior precision); a per-block list of the wrong length is refused in one line naming the file."""

    import h5py

    from posterior_fusion.artifact.reader import load_global
    from posterior_fusion.artifact.writer import text_attr
    from posterior_fusion.data.silo import read_silo
    from posterior_fusion.fusion import write_fused

    folder, paths = fitted
    inputs, result, meta = fuse(paths, "fedbens", FusionOptions(progress=False),
                                {"solver": "em", "prior_centre": "clients", "server_prior": "evidence", "steps": 20})
    lam = result.info["laplace"]["server_prior_precision"]
    blocks = result.curvatures[0].blocks
    assert isinstance(lam, list) and len(lam) == len(blocks) and len(set(lam)) > 1
    out = tmp_path / "g.h5"
    write_fused(out, inputs, result, meta)
    g = load_global(out)
    P = g.precision(0)
    assert [b.shift for b in P.blocks] == pytest.approx(lam)
    v = torch.randn(P.dim, dtype=torch.float64)
    want = sum(blk.quadratic_form(v[o: o + blk.dim].to(blk.dtype)).double() + lam_j * v[o: o + blk.dim].square().sum()
               for blk, o, lam_j in zip(result.curvatures[0].blocks, result.curvatures[0].offsets, lam))
    torch.testing.assert_close(P.quadratic_form(v.to(P.dtype)).double(), want, rtol=1e-4, atol=1e-4)
    x = read_silo(folder / "val.h5").inputs()[:16]
    for predictive in ("map", "mc", "glm", "glm-last-layer"):
        probs = g.predict(x, predictive=predictive, samples=4, raw=True)
        assert probs.shape == (16, 10) and torch.allclose(probs.sum(1), torch.ones(16, dtype=probs.dtype), atol=1e-5)
    bad = tmp_path / "bad.h5"
    bad.write_bytes(out.read_bytes())
    with h5py.File(bad, "r+") as f:
        m = json.loads(bytes(f.attrs["metadata"]).decode())
        m["laplace"]["prior_precision"] = lam[:-1]
        f.attrs["metadata"] = text_attr(json.dumps(m))
    r = CliRunner().invoke(pfuse, ["inspect", str(bad), "--validate"])
    assert r.exit_code == 2 and "laplace.prior_precision" in r.stderr and str(bad) in r.stderr
    assert r.stderr.count("\n") == 1


def test_the_server_prior_at_the_end_of_its_range_stays_inside_the_readers_range():
    """ρ at the end of its search range is the artifacts' largest prior precision over the largest block scale;
    ρ · c_j rounds one ulp past it for some c_j (1e8 · (1 + 2⁻⁵²)), which the reader would refuse: every λ0_j
    is clamped into the range the reader accepts."""
    from posterior_fusion import ranges
    from posterior_fusion.fusion.methods.fedbens.evidence import server_prior_blocks

    lo, hi = ranges.PRIOR_PRECISION
    scales = [3.0 * 10.0 ** k / 7.0 for k in range(-6, 7)] + [0.1 * k + 0.3 for k in range(1, 40)]
    rounded_past = [c for c in scales if (hi / c) * c > hi]
    assert rounded_past, "no scale rounds past the bound: the test would be empty"
    for c in scales:
        got = server_prior_blocks([c, 0.0], hi / c, 7.0)
        assert lo <= got[0] <= hi and got[1] == 7.0
        ranges.check("prior_precision", got[0], ranges.PRIOR_PRECISION)
