"""FedPPD's client step: SGLD recovers a known posterior (conjugate Bayesian linear regression),
and the distilled student matches the SGLD samples' predictive better than its starting point."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posterior_fusion.local.ppd import PPDConfig, distil_ppd, sgld


@pytest.mark.parametrize("centred", [False, True])
def test_sgld_recovers_the_conjugate_gaussian_posterior(centred):
    """y = Xw + ε, ε ~ N(0, σ²), prior w ~ N(w0, λ0⁻¹ I) (w0 = 0, or a base's weights): posterior N(μ, Λ⁻¹)
    with Λ = XᵀX/σ² + λ0 I and μ = Λ⁻¹ (Xᵀy/σ² + λ0 w0). SGLD's sample mean and variances match it."""
    gen = torch.Generator().manual_seed(0)
    n, d, sigma2, lam0 = 50, 3, 0.25, 2.0
    X = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + sigma2**0.5 * torch.randn(n, generator=gen,
                                                                                            dtype=torch.float64)
    Lam = X.T @ X / sigma2 + lam0 * torch.eye(d, dtype=torch.float64)
    cov = torch.linalg.inv(Lam)
    w0 = torch.tensor([20.0, 10.0, -20.0], dtype=torch.float64) if centred else torch.zeros(d, dtype=torch.float64)
    mu = cov @ (X.T @ y / sigma2 + lam0 * w0)
    model = nn.Linear(d, 1, bias=False).double()

    def nll(m, xb, yb):
        return ((m(xb)[:, 0] - yb) ** 2).sum() / (2 * sigma2)

    samples = []
    sgld(model, nll, X, y, steps=60000, step_size=1e-4, prior_precision=lam0, batch_size=n, burn_in=2000, thin=10,
         generator=torch.Generator().manual_seed(1),
         on_sample=lambda k, m, xb, yb: samples.append(m.weight.detach()[0].clone()), show_progress=False,
         prior_mean=w0 if centred else None)
    S = torch.stack(samples)
    sd = cov.diagonal().sqrt()
    assert ((S.mean(0) - mu).abs() / sd).max() < 0.2, (S.mean(0), mu)
    assert ((S.var(0) / cov.diagonal()) - 1).abs().max() < 0.15, (S.var(0), cov.diagonal())
    # and not a point mass at the mode (the noise term is there)
    assert (S.std(0) > 0.5 * sd).all()


def test_ppd_student_moves_towards_the_samples_predictive(fmnist_train):
    from posterior_fusion.models import ModelSpec

    x, y = fmnist_train
    xs = torch.as_tensor(x[:200]).float() / 255.0
    ys = torch.as_tensor(y[:200]).long()
    spec = ModelSpec("mlp", {"hidden": 16})
    torch.manual_seed(0)
    start = torch.nn.utils.parameters_to_vector(spec.build().parameters()).detach()
    cfg = PPDConfig(steps=300, burn_in=100, thin=2, step_size=1e-4, batch_size=32, student_lr=0.05, perturb=0.05)
    student, record = distil_ppd(spec.build, start, xs, ys, cfg, prior_precision=10.0, temperature=1.0, seed=0,
                                 show_progress=False)
    assert record["samples"] == 100
    # the student's predictions on the data moved from the (random) start towards the labels the chain learnt
    from posterior_fusion.models.functional import batched_logits

    acc = lambda w: (batched_logits(spec, w[None], xs)[0].argmax(-1) == ys).float().mean().item()  # noqa: E731
    assert acc(student) > acc(start) + 0.2


def test_a_diverging_sgld_chain_is_refused_naming_its_step_size(tmp_path, fmnist_train):
    """A step size far too large for n / T sends the chain to inf/NaN: the library says which setting
    to lower and to what scale; the CLI says it in one line as a flag, exit 2, and writes nothing."""
    from click.testing import CliRunner

    from posterior_fusion.cli.main import pfuse
    from posterior_fusion.data.silo import SiloData, write_silo
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.models import ModelSpec

    x, y = fmnist_train
    xs, ys = torch.as_tensor(x[:200]).float() / 255.0, torch.as_tensor(y[:200]).long()
    spec = ModelSpec("mlp", {"hidden": 16})
    start = torch.nn.utils.parameters_to_vector(spec.build().parameters()).detach()
    cfg = PPDConfig(steps=200, burn_in=10, thin=2, step_size=10.0, batch_size=32)
    with pytest.raises(ConfigError, match=r"`ppd_step_size` 10 is too large .* n / T = 2e\+03"):
        distil_ppd(spec.build, start, xs, ys, cfg, prior_precision=1.0, temperature=0.1, seed=0, show_progress=False)
    write_silo(tmp_path / "s.h5", SiloData(x[:200], y[:200], "fmnist", 10))
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "mlp", "--model-kwargs",
                                   '{"hidden": 8}', "-M", "1", "--epochs", "1", "--ppd", "--ppd-steps", "200",
                                   "--ppd-burn-in", "10", "--ppd-step-size", "10", "--out", str(tmp_path / "p.h5")])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and "--ppd-step-size" in lines[-1] and "diverged" in lines[-1], r.output
    assert lines[-1].startswith("error:") and not (tmp_path / "p.h5").exists()


def test_fit_local_ppd_stores_students_and_fedppd_averages_them(tmp_path, fmnist_train):
    """``fit-local --ppd`` writes ``/components/<m>/ppd_student`` (read back equal); ``fedppd`` is
    the n-weighted average of the students (by hand); ``fedppd-distill`` needs unlabeled data."""
    import h5py
    from click.testing import CliRunner

    import posterior_fusion
    from posterior_fusion.cli.main import pfuse
    from posterior_fusion.data.silo import SiloData, write_silo

    x, y = fmnist_train
    paths = []
    for c, n in enumerate((60, 120)):
        silo = tmp_path / f"silo{c}.h5"
        write_silo(silo, SiloData(x[c * 200 : c * 200 + n], y[c * 200 : c * 200 + n], "fmnist", 10))
        paths.append(tmp_path / f"c{c}.h5")
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(silo), "--model", "mlp", "--model-kwargs",
                                       '{"hidden": 8}', "--components", "2", "--epochs", "1", "--structure", "diag",
                                       "--ppd", "--ppd-steps", "40", "--ppd-burn-in", "10", "--ppd-thin", "5",
                                       "--out", str(paths[-1])])
        assert r.exit_code == 0, r.output
    with h5py.File(paths[0]) as f:
        stored = f["/components/1/ppd_student"][()]
    clients = [posterior_fusion.load(p) for p in paths]
    comp = clients[0].components[1]
    assert comp.student is not None and torch.equal(comp.student, torch.as_tensor(stored))
    assert comp.training["ppd_samples"] == 6 and not torch.equal(comp.student, comp.map)
    out = tmp_path / "g.h5"
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedppd", "--out", str(out)])
    assert r.exit_code == 0, r.output
    want = (60 * clients[0].components[0].student + 120 * clients[1].components[0].student) / 180
    torch.testing.assert_close(posterior_fusion.load(out).members[0], want, rtol=1e-6, atol=1e-7)
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedppd-distill", "--out", str(tmp_path / "h.h5")])
    assert r.exit_code == 2 and "needs unlabeled server data" in r.output
    unl = tmp_path / "unl.h5"
    write_silo(unl, SiloData(x[1000:1100], None, "fmnist", 10))
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedppd-distill", "--unlabeled", str(unl),
                                   "--set", "distill_epochs=2", "--out", str(tmp_path / "h.h5")])
    assert r.exit_code == 0, r.output
    meta = posterior_fusion.load(tmp_path / "h.h5").metadata
    assert meta["distill"]["teachers"] == 1 + 2 + 10  # Algorithm 3: w̄, the 2 clients' students, 10 Gaussian draws
    # a client without students is refused with the file named
    plain = tmp_path / "plain.h5"
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "silo0.h5"), "--model", "mlp", "--model-kwargs",
                                   '{"hidden": 8}', "--components", "2", "--epochs", "1", "--structure", "diag",
                                   "--out", str(plain)])
    assert r.exit_code == 0
    r = CliRunner().invoke(pfuse, ["fuse", str(plain), str(paths[1]), "--method", "fedppd", "--out", str(tmp_path / "k.h5")])
    assert r.exit_code == 2 and "plain.h5" in r.output and "fit-local --ppd" in r.output


def test_fedppd_distill_ensemble_is_algorithm_3s(tmp_path, small_silo, monkeypatch):
    """E_S = {w̄} ∪ {w_i} ∪ {S Gaussian draws}: counted and identified member by member."""
    from conftest import fit_artifact

    import posterior_fusion
    from posterior_fusion.artifact import write_client_artifact
    from posterior_fusion.data.silo import SiloData
    from posterior_fusion.fusion import FusionInputs, FusionOptions
    from posterior_fusion.fusion.methods import fedppd as mod
    from posterior_fusion.fusion.methods.fedppd import FedPPDDistillSettings, fedppd_distill
    from posterior_fusion.posterior import Component

    gen = torch.Generator().manual_seed(3)
    clients = []
    for c, n in enumerate((40, 120)):  # unequal n: the weights matter
        part = SiloData(small_silo.x[:n], small_silo.y[:n], "fmnist", 10)
        meta, comps = fit_artifact(tmp_path / f"p{c}.h5", part, "diag", mixtures=2)
        with_students = [Component(k.index, k.map, k.curvature, k.training, k.temperature, k.prior_precision,
                                   student=torch.randn(k.map.numel(), generator=gen)) for k in comps]
        write_client_artifact(tmp_path / f"s{c}.h5", posterior_fusion.load(tmp_path / f"p{c}.h5").model_spec,
                              posterior_fusion.load(tmp_path / f"p{c}.h5").layout, meta, with_students)
        clients.append(posterior_fusion.load(tmp_path / f"s{c}.h5"))
    seen = {}

    def fake_distill(spec, teachers, start, x, cfg, generator, progress):
        seen.update(teachers=teachers.clone(), start=start.clone())
        return start.clone(), {"teachers": int(teachers.shape[0])}

    monkeypatch.setattr(mod, "distill", fake_distill)
    unlabeled = SiloData(small_silo.x[:20], None, "fmnist", 10)
    inputs = FusionInputs(clients, FusionOptions(progress=False, sampling_seed=4, component=1), unlabeled=unlabeled)
    result = fedppd_distill(inputs, FedPPDDistillSettings(num_samples=3))
    T = seen["teachers"].double()
    # one student per client, of component 1 (one shared start); component 0's never enter
    assert T.shape[0] == 1 + 2 + 3 and result.info["ensemble"][:3] == ["average", "client 0 student 1",
                                                                         "client 1 student 1"]
    students = torch.stack([c.components[1].student.double() for c in clients])  # (C, d)
    weights = torch.tensor([40 / 160, 120 / 160], dtype=torch.float64)[:, None]
    w_bar = (weights * students).sum(0)
    torch.testing.assert_close(T[0], w_bar, rtol=1e-5, atol=1e-6)                  # the averaged student w̄
    torch.testing.assert_close(T[1:3], students, rtol=0, atol=0)                    # every client student
    var = (weights * (students - w_bar).square()).sum(0)
    draws = w_bar + var.sqrt() * torch.randn(3, w_bar.numel(), generator=torch.Generator().manual_seed(4)).double()
    torch.testing.assert_close(T[3:], draws, rtol=1e-5, atol=1e-5)                  # S draws from N(w̄, diag var)
    torch.testing.assert_close(seen["start"].double(), w_bar, rtol=1e-5, atol=1e-6)  # distilled into w̄
