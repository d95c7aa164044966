"""The Bayesian part: Laplace at the fused modes vs the dense Hessian, sampling moments, GLM vs
Monte-Carlo, probit, and the uncertainty metrics against hand-computed and library references."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import TINY, TINY_LAYOUT, dense_neg_log_posterior, fit_split, random_clients, random_psd

import posterior_fusion
from posterior_fusion.artifact import write_global_artifact
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron
from posterior_fusion.data.silo import SiloData, read_silo, write_silo
from posterior_fusion.fusion import FusionOptions
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings
from posterior_fusion.fusion.mode_laplace import (
    evidence_prior_precision,
    laplace_mode_weights,
    mode_precisions,
    responsibilities,
)
from posterior_fusion.fusion.registry import METHODS
from posterior_fusion.fusion.types import FusionInputs
from posterior_fusion.metrics import (
    accuracy_coverage,
    auroc,
    classification_metrics,
    expected_calibration_error,
    maximum_calibration_error,
    ood_auroc,
)
from posterior_fusion.posterior import Component
from posterior_fusion.predictive import logit_moments, probit, sampled_link

T, LAMS, LAM0 = 0.5, [2.0, 3.0, 1.5], 2.5


def dense_reference(clients, w):
    """``H + Σ_c cov-term``: the dense Hessian of −log p(w|D) plus each client's mixture
    covariance term, which is what the stored precision approximates (docs/maths.md)."""
    # the dense torch.distributions objective (twice differentiable, independent of our kernels)
    H = torch.autograd.functional.hessian(lambda v: dense_neg_log_posterior(clients, v, T, LAMS, LAM0), w)
    resp = responsibilities(clients, [T] * 3, LAMS, w[None])
    d = w.numel()
    for c, lam, r in zip(clients, LAMS, resp):
        gs = []
        for comp in c.components:
            P = torch.block_diag(*[b.to_dense() for b in comp.curvature.blocks]) / T + lam * torch.eye(d, dtype=torch.float64)
            gs.append(P @ (w - comp.map))
        G = torch.stack(gs)
        mean = (r[0][:, None] * G).sum(0)
        H = H + (r[0][:, None, None] * G[:, :, None] * G[:, None, :]).sum(0) - torch.outer(mean, mean)
    return H


def diag_full_clients(seed: int):
    """Clients whose curvature is diag for all but the last layer and dense for it (diag+full)."""
    clients = random_clients("diag", C=3, M=2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    last = TINY_LAYOUT.entries[-2].size + TINY_LAYOUT.entries[-1].size
    for c in clients:
        for comp in c.components:
            g = comp.curvature.blocks[0].g
            object.__setattr__(comp, "curvature", BlockDiag([Diag(g[:-last]), Dense(random_psd(last, gen))]))
    return clients


@pytest.mark.parametrize("structure", ["diag", "diag+full", "kron"])
def test_mode_precision_matches_the_dense_hessian(structure):
    clients = diag_full_clients(11) if structure == "diag+full" else random_clients(structure, C=3, M=2, seed=11)
    w = torch.randn(TINY_LAYOUT.dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.3
    ref = dense_reference(clients, w)
    (curv,), (errors,) = mode_precisions(clients, [T] * 3, LAMS, LAM0, w[None])
    ours = curv.precision(1.0, LAM0).to_dense()
    if structure != "kron":
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
        assert errors == [0.0] * len(errors)
        return
    # Kronecker: exact off the diagonal blocks (zero), dense bias blocks exact, each weight block
    # the Frobenius-nearest Kronecker product with exactly the recorded relative error.
    for j, (block, off) in enumerate(zip(curv.blocks, curv.offsets)):
        sl = slice(off, off + block.dim)
        target = ref[sl, sl] - LAM0 * torch.eye(block.dim, dtype=torch.float64)
        got = block.to_dense()
        rel = float((got - target).norm() / target.norm())
        assert rel == pytest.approx(errors[j], abs=1e-9)
        if isinstance(block, Dense):
            assert rel < 1e-10
        else:
            assert 0 < rel < 1  # strictly better than the zero matrix
            # and no worse than the naive Kronecker of summed factors
            naive = torch.kron(sum(b.B for b in [c.curvature.blocks[j] for cl in clients for c in cl.components]),
                               sum(b.A for b in [c.curvature.blocks[j] for cl in clients for c in cl.components]))
            scale = (naive * target).sum() / naive.square().sum()
            assert rel <= float((scale * naive - target).norm() / target.norm()) + 1e-12
    mask = torch.block_diag(*[torch.ones(b.dim, b.dim, dtype=torch.float64) for b in curv.blocks])
    assert float((ref * (1 - mask)).abs().max()) < 1e-9


def test_component_and_global_samples_have_the_right_moments(tmp_path):
    gen = torch.Generator().manual_seed(0)
    d = TINY_LAYOUT.dim
    comp = Component(0, torch.randn(d, generator=gen, dtype=torch.float64),
                     BlockDiag([Dense(random_psd(d, gen))]), {}, 0.5, 2.0)
    x = comp.sample(200_000, gen)
    cov = torch.linalg.inv(comp.precision().to_dense())
    assert float((x.mean(0) - comp.map).abs().max()) < 4 * float(cov.diagonal().sqrt().max()) / math.sqrt(200_000) * 3
    emp = torch.cov(x.T)
    assert float((emp - cov).abs().max() / cov.abs().max()) < 0.03
    # a two-mode global posterior written and read back: mixture mean and covariance
    curvs = [BlockDiag([Diag(torch.rand(d, generator=gen, dtype=torch.float64) + 0.5)]) for _ in range(2)]
    mus = [torch.randn(d, generator=gen, dtype=torch.float64) for _ in range(2)]
    write_global_artifact(tmp_path / "g.h5", TINY, TINY_LAYOUT,
                          {"method": "fedbens", "mode_weights": [0.25, 0.75], "laplace": {"prior_precision": 1.5}},
                          mus, curvs)
    g = posterior_fusion.load(tmp_path / "g.h5")
    s = g.sample(200_000, gen)
    covs = [torch.linalg.inv(g.precision(k).to_dense().double()) for k in range(2)]
    mean = 0.25 * g.members[0].double() + 0.75 * g.members[1].double()
    mix_cov = sum(p * (c + torch.outer(m.double() - mean, m.double() - mean)) for p, c, m in zip((0.25, 0.75), covs, g.members))
    assert float((s.mean(0) - mean).abs().max()) < 0.02
    assert float((torch.cov(s.T) - mix_cov).abs().max() / mix_cov.abs().max()) < 0.03
    # log_prob is the mixture density (dense torch.distributions reference)
    w = s[:5]
    ref = torch.logsumexp(torch.stack([math.log(p) + torch.distributions.MultivariateNormal(
        m.double(), covariance_matrix=c).log_prob(w) for p, c, m in zip((0.25, 0.75), covs, g.members)]), 0)
    torch.testing.assert_close(g.log_prob(w), ref, rtol=1e-5, atol=1e-5)


def flat_logits(spec, x: torch.Tensor):
    """``f(flat) -> logits (n, C)`` of ``spec`` in float64 at the flat parameters ``flat`` (the dense
    reference's function for autograd Jacobians)."""
    from torch.func import functional_call

    model = spec.build().double()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [math.prod(s) for s in shapes]

    def f(flat):
        params = {n: t.reshape(s) for n, t, s in zip(names, torch.split(flat, sizes), shapes)}
        return functional_call(model, params, (x.double(),))

    return f


def test_glm_logit_covariance_and_mc_link_against_dense_references():
    torch.manual_seed(0)
    spec = TINY
    d = TINY_LAYOUT.dim
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(d, generator=gen)
    prec = BlockDiag([Kron(random_psd(3, gen), random_psd(4, gen)), Dense(random_psd(3, gen)),
                      Kron(random_psd(2, gen), random_psd(3, gen)), Dense(random_psd(2, gen))]).precision(0.5, 1.0)
    x = torch.randn(7, 4, generator=gen)
    mean, cov = logit_moments(spec, w, prec, x)
    f = flat_logits(spec, x)
    J = torch.autograd.functional.jacobian(f, w.double())  # (n, C, d)
    Sigma = torch.linalg.inv(prec.to_dense())
    ref_cov = torch.einsum("ncd,de,nke->nck", J, Sigma, J)
    torch.testing.assert_close(cov, ref_cov, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(mean, f(w.double()), rtol=1e-5, atol=1e-6)
    # Monte-Carlo link = Monte-Carlo over weights of the linearised model
    g2 = torch.Generator().manual_seed(5)
    W = prec.sample(200_000, g2).double()
    lin = f(w.double())[None] + torch.einsum("ncd,sd->snc", J, W)
    ref_probs = torch.softmax(lin, -1).mean(0)
    torch.testing.assert_close(sampled_link(mean, cov, 200_000, torch.Generator().manual_seed(6)), ref_probs,
                               rtol=0, atol=5e-3)


def test_probit_is_the_closed_form_and_close_to_the_integral():
    mu = torch.tensor([[1.3, 0.0], [-0.4, 0.0], [3.0, 0.0]], dtype=torch.float64)
    var = torch.tensor([0.7, 2.0, 5.0], dtype=torch.float64)
    cov = torch.zeros(3, 2, 2, dtype=torch.float64)
    cov[:, 0, 0] = var
    ours = probit(mu, cov)[:, 0]
    closed = torch.sigmoid(mu[:, 0] / torch.sqrt(1 + math.pi * var / 8))   # MacKay (1992)
    torch.testing.assert_close(ours, closed, rtol=1e-12, atol=1e-12)
    grid = torch.linspace(-40, 40, 200_001, dtype=torch.float64)
    for m, v, o in zip(mu[:, 0], var, ours):
        dens = torch.exp(-(grid - m) ** 2 / (2 * v)) / math.sqrt(2 * math.pi * v)
        integral = float(torch.trapezoid(torch.sigmoid(grid) * dens, grid))
        assert abs(integral - float(o)) < 0.02


def test_metrics_against_hand_computed_values_and_torchmetrics():
    # ECE / MCE on a known histogram: 4 inputs, 2 bins
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]])
    y = torch.tensor([0, 1, 1, 1])
    ece, table = expected_calibration_error(probs, y, bins=2)
    # bin (0.5, 1]: conf 0.9, 0.8, 0.7, 0.6 (mean 0.75), accuracy 3/4
    assert ece == pytest.approx(abs(0.75 - 0.75), abs=1e-6)
    probs2 = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.45, 0.55], [0.3, 0.7]])
    y2 = torch.tensor([1, 0, 1, 0])
    ece2, table2 = expected_calibration_error(probs2, y2, bins=4)
    # bins of width 0.25: (0.5,0.75]: conf .6,.55 acc 1,1 -> gap .425; (0.75,1]: conf .9,.7? no: .7 is in (0.5,0.75]
    confs = probs2.max(-1).values
    correct = (probs2.argmax(-1) == y2).float()
    hand_bins = {}
    for c, k in zip(confs.tolist(), correct.tolist()):
        b = min(int(c * 4 - 1e-9), 3)
        hand_bins.setdefault(b, []).append((c, k))
    hand_ece = sum(len(v) / 4 * abs(sum(k for _, k in v) / len(v) - sum(c for c, _ in v) / len(v)) for v in hand_bins.values())
    hand_mce = max(abs(sum(k for _, k in v) / len(v) - sum(c for c, _ in v) / len(v)) for v in hand_bins.values())
    assert ece2 == pytest.approx(hand_ece, abs=1e-6)
    assert maximum_calibration_error(table2) == pytest.approx(hand_mce, abs=1e-6)
    # AUROC: rank-based reference with ties, and torchmetrics as an independent oracle
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4, 0.9])
    labels = torch.tensor([0, 0, 1, 1, 1, 0]).bool()
    pairs = [(s_p > s_n) + 0.5 * (s_p == s_n) for s_p in scores[labels] for s_n in scores[~labels]]
    assert auroc(scores, labels) == pytest.approx(float(sum(pairs)) / len(pairs))
    from torchmetrics.functional.classification import binary_auroc, multiclass_calibration_error

    g = torch.Generator().manual_seed(0)
    s = torch.rand(500, generator=g)
    lab = torch.rand(500, generator=g) < s
    assert auroc(s, lab) == pytest.approx(float(binary_auroc(s, lab.long())), abs=1e-6)
    p = torch.softmax(torch.randn(400, 5, generator=g) * 2, -1)
    yy = torch.randint(0, 5, (400,), generator=g)
    m = classification_metrics(p, yy, bins=15)
    assert m["ece"] == pytest.approx(float(multiclass_calibration_error(p, yy, 5, n_bins=15, norm="l1")), abs=1e-5)
    assert m["mce"] == pytest.approx(float(multiclass_calibration_error(p, yy, 5, n_bins=15, norm="max")), abs=1e-5)
    # selective accuracy and OOD AUROC
    cov = accuracy_coverage(torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.8, 0.2], [0.55, 0.45]]), torch.tensor([0, 1, 0, 0]),
                            coverages=(0.5, 1.0))
    assert cov == [{"coverage": 0.5, "accuracy": 1.0}, {"coverage": 1.0, "accuracy": 0.75}]
    sharp, flat = torch.tensor([[0.99, 0.01]] * 3), torch.tensor([[0.5, 0.5]] * 2)
    assert ood_auroc(sharp, flat) == 1.0 and ood_auroc(flat, sharp) == 0.0


def test_mode_weights_from_the_laplace_evidence():
    prec = [BlockDiag([Diag(torch.full((3,), v, dtype=torch.float64))]) for v in (1.0, 4.0)]
    w = laplace_mode_weights(torch.tensor([2.0, 1.0]), prec)
    logits = torch.tensor([-2.0 - 0.5 * 3 * math.log(1.0), -1.0 - 0.5 * 3 * math.log(4.0)], dtype=torch.float64)
    torch.testing.assert_close(w, torch.softmax(logits, 0))


def test_evidence_prior_precision_is_the_conjugate_models_evidence_maximiser():
    """Bayesian linear regression (unit noise, prior N(0, δ⁻¹ I)): the exact log evidence
    log N(y; 0, I + X Xᵀ / δ) is maximised over δ by scipy on the dense covariance; at that δ̂ the
    posterior mode is w* = (XᵀX + δ̂ I)⁻¹ Xᵀ y, and the Laplace evidence with w* held fixed is
    maximised at the same δ̂ (MacKay's fixed point γ(δ̂) = δ̂ ‖w*‖² is the exact optimum's condition)."""
    from scipy.optimize import minimize_scalar

    gen = torch.Generator().manual_seed(5)
    n, d = 40, 7
    X = torch.randn(n, d, generator=gen, dtype=torch.float64) * torch.linspace(0.05, 2.0, d, dtype=torch.float64)
    y = X @ (0.7 * torch.randn(d, generator=gen, dtype=torch.float64)) + torch.randn(n, generator=gen, dtype=torch.float64)

    def neg_log_evidence(t: float) -> float:
        cov = torch.eye(n, dtype=torch.float64) + X @ X.T / math.exp(t)
        return -torch.distributions.MultivariateNormal(torch.zeros(n, dtype=torch.float64), cov).log_prob(y).item()

    t_hat = minimize_scalar(neg_log_evidence, bounds=(-10.0, 10.0), method="bounded", options={"xatol": 1e-10}).x
    delta_hat = math.exp(t_hat)
    G = X.T @ X
    w_star = torch.linalg.solve(G + delta_hat * torch.eye(d, dtype=torch.float64), X.T @ y)
    delta, _ = evidence_prior_precision([w_star], [BlockDiag([Dense(G)])])
    assert delta == pytest.approx(delta_hat, rel=1e-5)


def test_evidence_prior_precision_against_dense_eigenvalues():
    """Two modes whose curvatures mix Kronecker, diagonal (with zero entries) and dense blocks: the
    returned δ solves Σ_k γ_k(δ) = δ Σ_k ‖w*_k‖², γ from the dense float64 eigenvalues (scipy's brentq),
    and the returned maximum is the dense Σ_k [−½ δ ‖w*_k‖² + ½ d log δ − ½ log|G_k + δ I|]."""
    from scipy.optimize import brentq

    gen = torch.Generator().manual_seed(9)
    members, curvatures = [], []
    for k in range(2):
        g = torch.rand(5, generator=gen, dtype=torch.float64) * 30
        g[:2] = 0.0
        blocks = [Kron(random_psd(3, gen) * 10, random_psd(4, gen)), Diag(g), Dense(random_psd(6, gen) * (k + 1))]
        curvatures.append(BlockDiag([b.astype(torch.float32) for b in blocks]))
        members.append(torch.randn(12 + 5 + 6, generator=gen) * (0.5 + k))
    dense = [torch.linalg.eigvalsh(c.astype(torch.float64).to_dense()) for c in curvatures]
    sq = sum(float(w.double().square().sum()) for w in members)

    def condition(t: float) -> float:
        delta = math.exp(t)
        return sum(float((lam / (lam + delta)).sum()) for lam in dense) - delta * sq

    delta_ref = math.exp(brentq(condition, -15, 15, xtol=1e-12))
    delta, value = evidence_prior_precision(members, curvatures)
    assert delta == pytest.approx(delta_ref, rel=1e-5)
    ref = sum(-0.5 * delta * float(w.double().square().sum()) + 0.5 * w.numel() * math.log(delta)
              - 0.5 * float(torch.log(lam + delta).sum()) for w, lam in zip(members, dense))
    assert value == pytest.approx(ref, rel=1e-7)  # the blocks are float32: their eigenvalues carry ~1e-7


def test_fedbens_records_the_evidence_prior_and_predicts_with_it():
    """`laplace_prior=evidence`: the artifact's Λ*_k = curvature_k + δ I with δ the evidence maximiser of
    its own modes and curvatures, the server's λ0 kept beside it; `server` keeps λ0; bad values refused."""
    clients = random_clients("kron", C=3, M=2, seed=4)
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    res = METHODS["fedbens"](inputs, FedBEnsSettings(steps=20, laplace_prior="evidence", solver="adam"))
    lap = res.info["laplace"]
    delta, value = evidence_prior_precision(list(res.members), list(res.curvatures))
    assert lap["prior_rule"] == "evidence" and lap["prior_precision"] == pytest.approx(delta, rel=1e-12)
    assert lap["log_evidence_terms"] == pytest.approx(value) and lap["server_prior_precision"] == inputs.server_prior_precision()
    assert lap["prior_precision"] != pytest.approx(lap["server_prior_precision"], rel=1e-3)
    plain = METHODS["fedbens"](inputs, FedBEnsSettings(steps=20, solver="adam"))
    assert plain.info["laplace"]["prior_rule"] == "server"
    assert plain.info["laplace"]["prior_precision"] == inputs.server_prior_precision()
    for bad, match in (({"laplace_prior": "often"}, "laplace_prior"),
                       ({"laplace_prior": "evidence", "laplace": False}, "laplace=true")):
        with pytest.raises(posterior_fusion.errors.ConfigError, match=match):
            FedBEnsSettings(**bad).validate()


@pytest.fixture(scope="module")
def fused(tmp_path_factory, fmnist_train):
    x, y = fmnist_train
    folder = tmp_path_factory.mktemp("pred")
    silo = SiloData(x[:600], y[:600], "fmnist", 10)
    paths = fit_split(folder, silo, 3, 200, "kron", mixtures=2, epochs=2)
    write_silo(folder / "test.h5", SiloData(x[3000:3400], y[3000:3400], "fmnist", 10))
    write_silo(folder / "ood.h5", SiloData((255 - x[3400:3600]).copy(), y[3400:3600], "fmnist", 10))
    for weights in ("equal", "laplace"):
        r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedbens", "--set", "steps=30", "--set", f"mode_weights={weights}",
                                       "--val", str(folder / "test.h5"), "--out", str(folder / f"g_{weights}.h5")])
        assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "ensemble", "--out", str(folder / "ens.h5")])
    assert r.exit_code == 0
    return folder


def test_end_to_end_predictives_metrics_and_plot(fused):
    folder = fused
    g = posterior_fusion.load(folder / "g_equal.h5")
    assert g.has_posterior and len(g.metadata["laplace"]["block_relative_errors"]) == 2
    x = torch.zeros(3, 1, 28, 28)
    for predictive in ("map", "mc", "glm"):
        p = g.predict(x, predictive, samples=4)
        torch.testing.assert_close(p.sum(-1), torch.ones(3))
    for weights in ("equal", "laplace"):
        r = CliRunner().invoke(pfuse, ["evaluate", str(folder / f"g_{weights}.h5"), "--data", str(folder / "test.h5"),
                                       "--predictive", "glm", "--ood", str(folder / "ood.h5"), "--json"])
        assert r.exit_code == 0, r.stderr
        assert "ood_auroc" in r.stdout and '"mce"' in r.stdout
    plot = folder / "rel.pdf"
    r = CliRunner().invoke(pfuse, ["evaluate", str(folder / "g_equal.h5"), str(folder / "ens.h5"), "--data",
                                   str(folder / "test.h5"), "--plot", str(plot)])
    assert r.exit_code == 0, r.stderr
    assert plot.read_bytes()[:4] == b"%PDF" and len(r.stdout.strip().splitlines()) == 2
    r = CliRunner().invoke(pfuse, ["evaluate", str(folder / "ens.h5"), "--data", str(folder / "test.h5"),
                                   "--predictive", "mc"])
    assert r.exit_code == 2 and "needs a global posterior" in r.stderr
    r = CliRunner().invoke(pfuse, ["predict", str(folder / "g_equal.h5"), "--data", str(folder / "test.h5"),
                                   "--predictive", "mc", "--samples", "3", "--out", str(folder / "p.h5")])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(pfuse, ["evaluate", str(folder / "g_equal.h5"), "--data", str(folder / "test.h5"),
                                   "--predictive", "glm", "--scale-from", str(folder / "test.h5"), "--json"])
    assert r.exit_code == 0 and "chosen on" in r.stderr, r.stderr
    import json

    out = json.loads(r.stdout)
    grid = out["scale_tuning"]["grid"]
    assert out["scale"] == min(grid, key=lambda g: (g["val_nll"], -g["scale"]))["scale"]


def test_the_api_applies_the_artifacts_input_transform(fused):
    """``GlobalEnsemble.predict`` on stored inputs (numpy uint8, float64, torch) equals the CLI's
    path (transformed inputs, ``raw=True``); ``read_data`` gives inputs with their transform; a
    shape the model cannot take is one line."""
    from posterior_fusion.errors import PfuseError

    g = posterior_fusion.load(fused / "g_equal.h5")
    data = posterior_fusion.read_data(fused / "test.h5")
    assert data.input_transform.key() == posterior_fusion.data.transform.InputTransform.from_dict(
        g.metadata["input_transform"]).key()
    want = g.predict(data.inputs(), raw=True)
    for x in (data.x, data.x.astype(np.float64), torch.from_numpy(data.x)):
        torch.testing.assert_close(g.predict(x), want)
    assert not torch.allclose(g.predict(data.x, raw=True), want)  # untransformed pixels are other inputs
    client = posterior_fusion.load(fused / "post_0.h5")
    torch.testing.assert_close(client.predict(data.x), client.predict(data.inputs(), raw=True))
    with pytest.raises(PfuseError, match="inputs"):
        g.predict(np.zeros((2, 8, 8), np.uint8))
    with pytest.raises(PfuseError, match="real array"):
        g.predict(np.array(["a", "b"]))


@pytest.mark.parametrize("structure", ["kron", "diag", "diag+full"])
def test_last_layer_glm_equals_the_dense_jacobian_restricted_to_the_last_layer(structure):
    """glm-last-layer's logit covariance = J_ll Λ_ll⁻¹ J_llᵀ with J_ll the last layer's columns of
    the full Jacobian (autograd, float64) and Λ_ll the dense precision's block over that layer (its
    marginal: Λ is block-diagonal), for Kronecker, diagonal and diagonal + full-last-layer precisions."""
    from posterior_fusion.predictive import last_layer_moments

    spec = TINY
    d = TINY_LAYOUT.dim
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(d, generator=gen)
    if structure == "kron":
        raw = BlockDiag([Kron(random_psd(3, gen), random_psd(4, gen)), Dense(random_psd(3, gen)),
                         Kron(random_psd(2, gen), random_psd(3, gen)), Dense(random_psd(2, gen))])
    elif structure == "diag":
        raw = BlockDiag([Diag(torch.rand(d, generator=gen, dtype=torch.float64))])
    else:
        raw = BlockDiag([Diag(torch.rand(15, generator=gen, dtype=torch.float64)), Dense(random_psd(d - 15, gen))])
    prec = raw.precision(0.5, 1.0)
    x = torch.randn(9, 4, generator=gen)
    mean, cov = last_layer_moments(spec, w, prec, x, batch_size=4)
    f = flat_logits(spec, x)
    J = torch.autograd.functional.jacobian(f, w.double())[:, :, 15:]  # the last Linear: weight (2, 3), bias (2)
    L = prec.to_dense().double()[15:, 15:]
    ref = torch.einsum("ncd,de,nke->nck", J, torch.linalg.inv(L), J)
    torch.testing.assert_close(cov, ref, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(mean, f(w.double()), rtol=1e-5, atol=1e-6)


def _model_precision(spec, structure: str, gen: torch.Generator) -> BlockDiag:
    """A random raw curvature over ``spec``'s parameters: K-FAC (Kron per Linear/Conv2d weight, Dense
    per bias, Diag per normalisation parameter), diag, or diag + a full block over the last layer."""
    from posterior_fusion.layout import ParameterLayout

    layout = ParameterLayout.from_model(spec.build())
    if structure == "diag":
        return BlockDiag([Diag(torch.rand(layout.dim, generator=gen, dtype=torch.float64) + 0.1)])
    if structure == "diag+full":
        last = layout.entries[-1].offset if layout.entries[-1].matrix_shape else layout.entries[-2].offset
        return BlockDiag([Diag(torch.rand(last, generator=gen, dtype=torch.float64) + 0.1),
                          Dense(random_psd(layout.dim - last, gen))])
    blocks = []
    for e in layout.entries:
        if e.matrix_shape and len(e.shape) >= 2:
            out, inn = e.matrix_shape
            blocks.append(Kron(random_psd(out, gen), random_psd(inn, gen)))
        elif "norm" in e.name or e.name.split(".")[-2:-1] in (["n1"], ["n2"]):
            blocks.append(Diag(torch.rand(e.size, generator=gen, dtype=torch.float64)))
        else:
            blocks.append(Dense(random_psd(e.size, gen)))
    return BlockDiag(blocks)


def _blockwise_reference(J: torch.Tensor, prec: BlockDiag) -> torch.Tensor:
    """``Σ_b J_b Λ_b⁻¹ J_bᵀ`` ``(n, C, C)`` in float64 from the autograd Jacobian ``J`` ``(n, C, d)``: a
    dense inverse per block up to 3,000 parameters; a larger Kronecker block through eigenpairs of
    its own factors computed here (Λ = s·B⊗A + δ: Λ⁻¹ = (U_B⊗U_A) diag(1/(s b aᵀ + δ)) (U_B⊗U_A)ᵀ)."""
    out = torch.zeros(J.shape[0], J.shape[1], J.shape[1], dtype=torch.float64)
    for b, off in zip(prec.blocks, prec.offsets):
        Jb = J[:, :, off: off + b.dim]
        if isinstance(b, Diag):
            out += torch.einsum("ncd,d,nkd->nck", Jb, 1 / b.diagonal().double(), Jb)
        elif b.dim <= 3000:
            out += torch.einsum("ncd,de,nke->nck", Jb, torch.linalg.inv(b.to_dense().double()), Jb)
        else:
            bb, UB = torch.linalg.eigh(b.B.double())
            aa, UA = torch.linalg.eigh(b.A.double())
            Z = UB.T @ Jb.reshape(*Jb.shape[:2], *b.shape) @ UA
            lam = b.scale * torch.outer(bb, aa) + b.shift
            out += torch.einsum("ncij,nkij,ij->nck", Z, Z, 1 / lam)
    return out


@pytest.mark.parametrize("model,structure", [("lenet", "kron"), ("lenet", "diag"), ("lenet", "diag+full"),
                                             ("cnn", "kron"), ("resnet20-group", "kron")])
def test_structured_glm_equals_the_full_jacobian_covariance(model, structure):
    """``glm``'s layer-by-layer J Λ⁻¹ Jᵀ (per-block whitening of per-layer Jacobians from the capture's
    backward passes) equals the float64 autograd Jacobian of the whole network contracted with each
    block's inverse, for LeNet and the CNN (with biases: Dense blocks) and a GroupNorm ResNet-20
    (Diag blocks on the normalisation layers), for kron, diag and diag+full precisions."""
    from posterior_fusion.models import ModelSpec
    from posterior_fusion.predictive import structured_moments

    spec = {"lenet": ModelSpec("lenet", {"bias": True}), "cnn": ModelSpec("cnn", {"bias": True}),
            "resnet20-group": ModelSpec("resnet20", {"width": 4, "norm": "group", "in_channels": 1})}[model]
    gen = torch.Generator().manual_seed(11)
    d = sum(p.numel() for p in spec.build().parameters())
    w = 0.3 * torch.randn(d, generator=gen)
    prec = _model_precision(spec, structure, gen).precision(0.5, 2.0)
    x = torch.randn(3, *({"cnn": (3, 32, 32)}.get(model, (1, 28, 28))), generator=gen)
    mean, cov = structured_moments(spec, w, prec, x, batch_size=2)  # two batches
    f = flat_logits(spec, x)
    J = torch.autograd.functional.jacobian(f, w.double())  # (n, C, d), float64
    ref = _blockwise_reference(J, prec)
    torch.testing.assert_close(cov, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(mean, f(w.double()), rtol=1e-4, atol=1e-5)  # float32 forward pass


def test_structured_glm_batches_fit_the_memory_budget():
    from posterior_fusion.errors import PfuseError
    from posterior_fusion.models import ModelSpec
    from posterior_fusion.predictive import structured_batch_size, structured_moments

    spec = ModelSpec("lenet", {})
    model = spec.build().eval()
    x = torch.randn(5, 1, 28, 28)
    assert structured_batch_size(model, x, 10, 30720) == 64
    small = structured_batch_size(model, x, 10, 30720, max_memory=40 * 2**20)
    assert 1 <= small < 64
    with pytest.raises(PfuseError, match="GLM predictive"):
        structured_batch_size(model, x, 10, 30720, max_memory=2**20)
    gen = torch.Generator().manual_seed(2)
    prec = _model_precision(spec, "kron", gen).precision(1.0, 1.0)
    w = 0.3 * torch.randn(sum(p.numel() for p in model.parameters()), generator=gen)
    a = structured_moments(spec, w, prec, x)
    b = structured_moments(spec, w, prec, x, batch_size=2)
    # the batches do not change the numbers beyond float32 rounding (the reductions' order varies with threads:
    # up to ~1.1e-4 relative on the largest covariance entries)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_evaluate_map_weighs_the_modes_as_the_artifact_says(fused):
    """`evaluate --predictive map` scores Σ_k π_k softmax(f_k) with the stored mode weights (it once
    averaged the modes uniformly whatever `mode_weights` said)."""
    folder = fused
    g = posterior_fusion.load(folder / "g_laplace.h5")
    pi = g.mode_weights
    data = read_silo(folder / "test.h5")
    x, y = data.tensors()
    from posterior_fusion.models.functional import batched_logits

    probs = torch.softmax(batched_logits(g.model_spec, torch.stack(list(g.members)), x).double(), -1)
    mixture = torch.einsum("k,knc->nc", pi, probs)
    nll = -mixture.gather(1, y[:, None]).log().mean().item()
    r = CliRunner().invoke(pfuse, ["evaluate", str(folder / "g_laplace.h5"), "--data", str(folder / "test.h5"),
                                   "--json"])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    out = out[0] if isinstance(out, list) else out
    assert out["nll"] == pytest.approx(nll, rel=1e-5)
    uniform = -probs.mean(0).gather(1, y[:, None]).log().mean().item()
    assert abs(uniform - nll) > 1e-6   # the weights matter here
