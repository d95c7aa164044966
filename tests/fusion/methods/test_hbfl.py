"""HBFL's aggregation (paper 003, eqs. 3.8–3.12) against a hand-written dense float64 solve with
the q_k = n_k / n weights and no global prior; FedFisher's and HBFL's exact solver (``solver =
"exact"``, ``fusion/quadratic.py``) against the same dense solves, on plain and compressed curvature."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_artifact

import posterior_fusion
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion import FusionInputs, FusionOptions
from posterior_fusion.fusion.methods.fedfisher import fedfisher
from posterior_fusion.fusion.methods.hbfl import HBFLSettings, hbfl
from posterior_fusion.fusion.quadratic import QuadraticSettings


def structured_clients(tmp_path, silo, structure, sizes=(60, 100, 140), stride=4):
    """Three clients of unequal sizes (the q_k weights matter), fitted on every ``stride``-th pixel of the
    images: at the default 7 × 7 (d = 490 parameters) every dense float64 reference below is a small solve;
    ``stride=1`` the full images (d = 6,370), where K-FAC factors are rank-deficient and Adam's path long."""
    paths = []
    start = 0
    for c, n in enumerate(sizes):
        part = SiloData(silo.x[start : start + n, ::stride, ::stride].copy(), silo.y[start : start + n], "fmnist", 10)
        start += n
        paths.append(tmp_path / f"c{c}.h5")
        fit_artifact(paths[-1], part, structure, model="mlp", mixtures=1, epochs=1, seed=c,
                     kwargs={"in_features": part.x[0].size, "hidden": 8, "bias": True})
    return [posterior_fusion.load(p) for p in paths]


def _dense_problem(clients):
    """Λ = Σ q_k G_k / T_k and b = Σ q_k G_k / T_k ŵ_k, float64 dense; q_k = n_k / n."""
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    q = n / n.sum()
    Lam = sum(qk / c.components[0].temperature * c.components[0].curvature.astype(torch.float64).to_dense()
              for qk, c in zip(q, clients))
    rhs = sum(qk / c.components[0].temperature * c.components[0].curvature.astype(torch.float64).to_dense()
              @ c.components[0].map.double() for qk, c in zip(q, clients))
    avg = sum(qk * c.components[0].map.double() for qk, c in zip(q, clients))
    return Lam, rhs, avg


@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_hbfl_closed_form_equals_dense_solve(tmp_path, small_silo, structure):
    clients = structured_clients(tmp_path, small_silo, structure)
    settings = HBFLSettings(prior_scale=1e-6, mean="map")
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)), settings).members[0].double()
    Lam, rhs, avg = _dense_problem(clients)
    # the damping, block by block as documented: ε_j = damping · mean(diag Λ_jj), pulling to FedAvg
    eps = torch.zeros(Lam.shape[0], dtype=torch.float64)
    ref_blocks = clients[0].components[0].curvature
    for off, b in zip(ref_blocks.offsets, ref_blocks.blocks):
        sl = slice(off, off + b.dim)
        eps[sl] = settings.prior_scale * Lam.diagonal()[sl].mean()
    want = torch.linalg.solve(Lam + torch.diag(eps), rhs + eps * avg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    # the match is far tighter than the distance to FedAvg (the test would be empty otherwise)
    assert (got - avg).abs().max() > 20 * (got - want).abs().max()


def test_hbfl_kron_reaches_the_dense_optimum(tmp_path, small_silo):
    clients = structured_clients(tmp_path, small_silo, "kron", stride=1)
    settings = HBFLSettings(steps=6000, adam_lr=2e-2, clip=1e6, mean="map")
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)), settings).members[0].double()
    Lam, rhs, avg = _dense_problem(clients)

    def f(w):  # ½ Σ q_k (w − ŵ_k)ᵀ Λ_k (w − ŵ_k) up to a constant
        return 0.5 * w @ Lam @ w - rhs @ w

    eps = 1e-9 * Lam.diagonal().mean()
    best = torch.linalg.solve(Lam + eps * torch.eye(len(rhs), dtype=torch.float64), rhs + eps * avg)
    gap, scale = f(got) - f(best), f(avg) - f(best)
    assert scale > 0 and gap <= 1e-3 * scale, (gap, scale)


def _positive_clients(tmp_path, silo, structure, temps=(0.05, 0.1, 0.3), sizes=(60, 100, 140)):
    """The fitted clients with full-rank random curvature of the same block kinds and unequal T_k:
    the paper's division by the prior is well posed, so eq. 3.8 applies exactly."""
    from posterior_fusion.artifact import write_client_artifact
    from posterior_fusion.artifact.blocks import ENCODINGS
    from posterior_fusion.curvature import BlockDiag
    from posterior_fusion.posterior import Component

    gen = torch.Generator().manual_seed(5)
    out = []
    for k, (c, t) in enumerate(zip(structured_clients(tmp_path, silo, structure, sizes), temps)):
        comp = c.components[0]
        blocks = []
        for b in comp.curvature.blocks:  # each block kind rebuilt from well-conditioned positive tensors
            tensors = {}
            for name, raw in b.to_tensors().items():
                side = raw.shape[0]
                if raw.ndim == 1:
                    tensors[name] = (torch.rand(side, generator=gen, dtype=torch.float64) * 4 + 1).float()
                else:
                    a = torch.randn(side, side, generator=gen, dtype=torch.float64)
                    tensors[name] = (a @ a.T / side + torch.eye(side, dtype=torch.float64)).float()
            enc = ENCODINGS[b.kind]
            blocks.append(enc.decode(tensors, {**enc.header(b), "size": b.dim}))
        new = Component(0, comp.map, BlockDiag(blocks), comp.training, t, comp.prior_precision)
        meta = dict(c.metadata, temperature=t)
        path = tmp_path / f"pos{k}.h5"
        write_client_artifact(path, c.model_spec, c.layout, meta, [new])
        out.append(posterior_fusion.load(path))
    return out


def _paper_dense(clients, null_tol=0.0):
    """Eqs. 3.8-3.12 in dense float64: Λ_k = (G_k/T_k + λ0 I) − λ0 I, η_k = (G_k/T_k + λ0 I) ŵ_k − 0
    (with null_tol > 0 the prior term through the projector G/T (G/T + ε I)⁻¹, as documented)."""
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    q = n / n.sum()
    Lam, eta = 0, 0
    for qk, c in zip(q, clients):
        comp = c.components[0]
        G = comp.curvature.to_dense().double() / comp.temperature
        eye = torch.eye(G.shape[0], dtype=torch.float64)
        post = G + comp.prior_precision * eye                       # the Laplace posterior precision Λ1
        w = comp.map.double()
        if null_tol:
            eps = null_tol * G.diagonal().mean()
            prior_part = comp.prior_precision * G @ torch.linalg.solve(G + eps * eye, w)
            eta = eta + qk * (G @ w + prior_part)
        else:
            eta = eta + qk * (post @ w - comp.prior_precision * eye @ torch.zeros_like(w))  # η1 − η2, prior mean 0
        Lam = Lam + qk * (post - comp.prior_precision * eye)       # Λ1 − Λ2
    return Lam, eta


@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_hbfl_paper_mean_equals_a_dense_solve_of_eqs_3_8_to_3_12(tmp_path, small_silo, structure):
    clients = _positive_clients(tmp_path, small_silo, structure)
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)), HBFLSettings(prior_scale=0.0, null_tol=1e-12))
    Lam, eta = _paper_dense(clients)
    want = torch.linalg.solve(Lam, eta)
    torch.testing.assert_close(got.members[0].double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    old = hbfl(FusionInputs(clients, FusionOptions(progress=False)), HBFLSettings(prior_scale=0.0, mean="map"))
    # the two forms differ by far more than the match (the prior term matters at T λ0 ~ 1)
    assert (old.members[0].double() - want).abs().max() > 50 * (got.members[0].double() - want).abs().max()


@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_hbfl_paper_mean_is_well_posed_on_singular_curvature(tmp_path, small_silo, structure):
    """Real (singular) GGNs: the projector form, against its dense float64 reference; finite and
    near FedAvg where no client has curvature."""
    clients = structured_clients(tmp_path, small_silo, structure)
    settings = HBFLSettings(prior_scale=1e-6, null_tol=1e-4)
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)), settings).members[0].double()
    Lam, eta = _paper_dense(clients, settings.null_tol)
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    avg = sum(qk * c.components[0].map.double() for qk, c in zip(n / n.sum(), clients))
    eps = torch.zeros(Lam.shape[0], dtype=torch.float64)
    ref = clients[0].components[0].curvature
    for off, b in zip(ref.offsets, ref.blocks):
        eps[off : off + b.dim] = settings.prior_scale * Lam.diagonal()[off : off + b.dim].mean()
    want = torch.linalg.solve(Lam + torch.diag(eps), eta + eps * avg)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_hbfl_kron_paper_mean_reaches_the_dense_optimum(tmp_path, small_silo):
    clients = _positive_clients(tmp_path, small_silo, "kron")
    settings = HBFLSettings(steps=6000, adam_lr=2e-2, clip=1e6, null_tol=1e-12)
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)), settings).members[0].double()
    Lam, eta = _paper_dense(clients)
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    avg = sum(qk * c.components[0].map.double() for qk, c in zip(n / n.sum(), clients))

    def f(w):  # ½ wᵀ Λ w − wᵀ Σ q_k η_k
        return 0.5 * w @ Lam @ w - eta @ w

    eps = 1e-9 * Lam.diagonal().mean()
    best = torch.linalg.solve(Lam + eps * torch.eye(len(eta), dtype=torch.float64), eta + eps * avg)
    gap, scale = f(got) - f(best), f(avg) - f(best)
    assert scale > 0 and gap <= 1e-3 * scale, (gap, scale)


def test_soft_targets_with_full_weight_on_one_hot_labels_equal_plain_training(small_silo):
    """``(1 − β) CE(y) + β CE(one_hot(y))`` is CE(y) for any β: the same trajectory."""
    from posterior_fusion.local.fit_config import TrainConfig
    from posterior_fusion.local.train import train_map
    from posterior_fusion.models import ModelSpec

    x, y = small_silo.tensors()
    x, y = x[:128], y[:128]
    spec = ModelSpec("mlp", {"hidden": 8})
    runs = []
    for soft in (None, torch.nn.functional.one_hot(y, 10).float()):
        torch.manual_seed(0)
        model = spec.build()
        train_map(model, x, y, TrainConfig(epochs=2, weight_decay=0.0), seed=0, soft_targets=soft, soft_weight=0.7)
        runs.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


def plain_dim(folder) -> int:
    return posterior_fusion.load(folder / "plain.h5").layout.dim


def test_local_model_is_distilled_into_the_shared_model_and_never_stored(tmp_path, small_silo):
    """HBFL's heterogeneous client: a private MLP (another architecture) trained on the silo; the
    shared model trained with the distillation term agrees with it more often than without; the
    artifact holds neither the private weights nor its name or settings."""
    from click.testing import CliRunner

    from posterior_fusion.cli.main import pfuse
    from posterior_fusion.data.silo import write_silo

    silo = tmp_path / "silo.h5"
    write_silo(silo, SiloData(small_silo.x[:200], small_silo.y[:200], "fmnist", 10))
    common = ["fit-local", "--data", str(silo), "--model", "mlp", "--model-kwargs", '{"hidden": 16}',
              "--components", "1", "--epochs", "10", "--structure", "diag"]
    r = CliRunner().invoke(pfuse, [*common, "--out", str(tmp_path / "plain.h5")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(pfuse, [*common, "--local-model", "mlp", "--local-model-kwargs",
                                   '{"hidden_sizes": [57, 33]}', "--local-model-epochs", "6", "--local-model-weight", "0.9",
                                   "--out", str(tmp_path / "hbfl.h5")])
    assert r.exit_code == 0, r.output
    raw = (tmp_path / "hbfl.h5").read_bytes()
    assert b"hidden_sizes" not in raw  # neither the private architecture's settings ...
    art = posterior_fusion.load(tmp_path / "hbfl.h5")
    assert art.metadata["hbfl_local_model"] == {"weight": 0.9, "epochs": 6}
    assert len(art.components) == 1 and art.layout.dim == plain_dim(tmp_path)  # ... nor its weights
    # agreement with the local model's predictions: rebuild it exactly as fit-local did
    from posterior_fusion.local.fit_checks import local_model_teacher
    from posterior_fusion.local.fit_config import FitConfig, LocalModelConfig, TrainConfig
    from posterior_fusion.models.functional import batched_logits

    data = SiloData(small_silo.x[:200], small_silo.y[:200], "fmnist", 10)
    x, y = data.tensors()
    cfg = FitConfig(structure="diag", train=TrainConfig(epochs=10),
                    local_model=LocalModelConfig("mlp", {"hidden_sizes": [57, 33]}, 6, 0.9)).resolved(200)
    teacher = local_model_teacher(cfg, x, y, 10, log=lambda m: None)
    plain = posterior_fusion.load(tmp_path / "plain.h5")

    def cross_entropy_to_teacher(a):  # what the distillation term lowers
        logq = torch.log_softmax(batched_logits(a.model_spec, a.components[0].map[None], x)[0], -1)
        return -(teacher * logq).sum(-1).mean().item()

    assert cross_entropy_to_teacher(art) < 0.9 * cross_entropy_to_teacher(plain)


def _block_damping(clients, Lam, damping):
    """``(d,)`` ε per parameter: ``damping`` × the mean diagonal of Λ over each block, as documented."""
    eps = torch.zeros(Lam.shape[0], dtype=torch.float64)
    ref = clients[0].components[0].curvature
    for off, b in zip(ref.offsets, ref.blocks):
        eps[off : off + b.dim] = damping * Lam.diagonal()[off : off + b.dim].mean()
    return eps


def _fedfisher_dense(clients, damping):
    """FedFisher's minimiser in dense float64: (Σ G_c + ε) w = Σ G_c ŵ_c + ε · FedAvg."""
    Gs = [c.components[0].curvature.astype(torch.float64).to_dense() for c in clients]
    Lam = sum(Gs)
    rhs = sum(G @ c.components[0].map.double() for G, c in zip(Gs, clients))
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    avg = sum(qk * c.components[0].map.double() for qk, c in zip(n / n.sum(), clients))
    eps = _block_damping(clients, Lam, damping)
    return torch.linalg.solve(Lam + torch.diag(eps), rhs + eps * avg), avg


@pytest.mark.parametrize("structure", ["diag", "diag+full", "kron"])
def test_fedfisher_exact_solver_equals_the_dense_minimiser(tmp_path, small_silo, structure):
    """Real (singular) GGNs of three unequal clients: the exact solver's model is the dense solve of
    the quadratic's normal equations, far closer to it than FedAvg or 30 Adam steps are."""
    clients = structured_clients(tmp_path, small_silo, structure)
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    settings = QuadraticSettings(solver="exact", prior_scale=1e-4)  # converges in ~40 CG steps per layer
    got = fedfisher(inputs, settings)
    want, avg = _fedfisher_dense(clients, settings.prior_scale)
    err = (got.members[0].double() - want).abs().max()
    assert err <= 1e-4 * want.abs().max(), err
    adam = fedfisher(inputs, QuadraticSettings(steps=30)).members[0].double()
    assert min((avg - want).abs().max(), (adam - want).abs().max()) > 50 * err
    assert got.info["solver"] == "exact" and (structure != "kron" or got.info["iterations"] > 0)


def test_hbfl_kron_exact_solver_equals_the_dense_solve(tmp_path, small_silo):
    """Eqs. 3.8–3.12 with Kronecker curvature solved exactly (conjugate gradients per layer) equal the
    dense float64 solve, to far tighter than 6,000 Adam steps reach (the test above allows 1e-3 of the
    objective's range)."""
    clients = _positive_clients(tmp_path, small_silo, "kron")
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)),
               HBFLSettings(solver="exact", prior_scale=0.0, null_tol=1e-12)).members[0].double()
    Lam, eta = _paper_dense(clients)
    want = torch.linalg.solve(Lam, eta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    singular = structured_clients(tmp_path / "singular", small_silo, "kron")  # real GGNs: the damping's fallback to FedAvg
    settings = HBFLSettings(solver="exact", prior_scale=1e-4, mean="map")
    got = hbfl(FusionInputs(singular, FusionOptions(progress=False)), settings).members[0].double()
    Lam, rhs, avg = _dense_problem(singular)
    eps = _block_damping(singular, Lam, settings.prior_scale)
    want = torch.linalg.solve(Lam + torch.diag(eps), rhs + eps * avg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_exact_solver_on_compressed_curvature_solves_the_compressed_quadratic(tmp_path, small_silo):
    """Compressed artifacts (low rank + isotropic factors): the exact solver's model is the dense
    solve with each factor as stored (reconstructed), not the plain one's."""
    from posterior_fusion.artifact import write_client_artifact
    from posterior_fusion.curvature import Kron
    from posterior_fusion.curvature.compressed import CompressedKron, Compression

    plain = structured_clients(tmp_path, small_silo, "kron")
    compressed = []
    for k, c in enumerate(plain):
        path = tmp_path / f"small{k}.h5"
        write_client_artifact(path, c.model_spec, c.layout, dict(c.metadata), list(c.components),
                              Compression(0.3, "frobenius", "float32"))
        compressed.append(posterior_fusion.load(path))
    kinds = [type(b) for c in compressed for b in c.components[0].curvature.blocks if isinstance(b, Kron)]
    assert kinds and set(kinds) == {CompressedKron}  # every Kronecker block compressed (biases stay dense)
    settings = QuadraticSettings(solver="exact", prior_scale=1e-4)
    got = fedfisher(FusionInputs(compressed, FusionOptions(progress=False)), settings).members[0].double()
    want, _ = _fedfisher_dense(compressed, settings.prior_scale)
    other, _ = _fedfisher_dense(plain, settings.prior_scale)
    err = (got - want).abs().max()
    assert err <= 1e-4 * want.abs().max(), err
    assert (other - want).abs().max() > 50 * err  # the compression changes the answer by more than the match


def test_an_unconverged_exact_solve_says_so(tmp_path, small_silo):
    """Tiny prior_scale on real, rank-deficient K-FAC factors: conjugate gradients stop at their cap with
    a residual far above the tolerance, and the solve warns (naming the setting) instead of passing
    the unreliable model on silently."""
    clients = structured_clients(tmp_path, small_silo, "kron", stride=1)
    with pytest.warns(UserWarning, match="raise `prior_scale`"):
        got = fedfisher(FusionInputs(clients, FusionOptions(progress=False)), QuadraticSettings(solver="exact",
                                                                                                prior_scale=1e-6))
    assert got.info["residual"] > 1e-6


def test_tune_prior_scale_keeps_the_best_validation_solve(tmp_path, small_silo, fmnist_train):
    """``tune_prior_scale``: every grid scale is solved, the kept one has the best recorded validation
    accuracy, that accuracy is the returned model's own, and the model is the plain exact solve at the
    kept scale (the warm starts change nothing but the iteration counts)."""
    from posterior_fusion.fusion.optimise import accuracy_of
    from posterior_fusion.fusion.quadratic import PRIOR_SCALE_GRID

    clients = structured_clients(tmp_path, small_silo, "kron")
    x, y = fmnist_train
    val = SiloData(x[1000:1400, ::4, ::4].copy(), y[1000:1400], "fmnist", 10)
    inputs = FusionInputs(clients, FusionOptions(progress=False), val=val)
    got = fedfisher(inputs, QuadraticSettings(solver="exact", tune_prior_scale=True))
    search = got.info["prior_scale_search"]
    assert [r["prior_scale"] for r in search] == list(PRIOR_SCALE_GRID)
    best = max(search, key=lambda r: r["val_accuracy"])
    assert got.info["prior_scale"] == best["prior_scale"]
    own = float(accuracy_of(clients[0].model_spec, got.members[0][None], val)[0])
    assert own == pytest.approx(best["val_accuracy"])
    assert len({round(r["val_accuracy"], 4) for r in search}) > 1  # the choice is not vacuous
    direct = fedfisher(inputs, QuadraticSettings(solver="exact", prior_scale=best["prior_scale"])).members[0]
    torch.testing.assert_close(got.members[0], direct, rtol=1e-4, atol=1e-5 * float(direct.abs().max()))
    with pytest.raises(ConfigError, match="pass `val`"):
        fedfisher(FusionInputs(clients, FusionOptions(progress=False)), QuadraticSettings(solver="exact",
                                                                                          tune_prior_scale=True))


def test_solver_setting_is_checked():
    with pytest.raises(ConfigError, match="solver"):
        HBFLSettings.from_mapping({"solver": "em"}, "hbfl")
    with pytest.raises(ConfigError, match="'prior_scale'"):
        QuadraticSettings.from_mapping({"prior_scale": -1.0}, "fedfisher")
    # the former names: refused with the new name, not with a bare "no setting"
    with pytest.raises(ConfigError, match="'damping' is now 'prior_scale'"):
        QuadraticSettings.from_mapping({"damping": 0.01}, "fedfisher")
    with pytest.raises(ConfigError, match="'tune_damping' is now 'tune_prior_scale'"):
        HBFLSettings.from_mapping({"tune_damping": "true", "solver": "exact"}, "hbfl")
    with pytest.raises(ConfigError, match="'tune_prior_scale' needs solver=exact"):
        QuadraticSettings.from_mapping({"tune_prior_scale": "true"}, "fedfisher")


def _six_decade_clients(tmp_path, silo, structure, temps=(0.05, 0.1, 0.3)):
    """The fitted clients with full-rank curvature whose eigenvalues span six decades (a realistic GGN's
    conditioning): diagonal entries and dense-block spectra log-spaced over [1e-6, 1] (shuffled, random
    eigenbases); a Kronecker block's two factors over three decades each (their products span six)."""
    from posterior_fusion.artifact import write_client_artifact
    from posterior_fusion.artifact.blocks import ENCODINGS
    from posterior_fusion.curvature import BlockDiag
    from posterior_fusion.posterior import Component

    gen = torch.Generator().manual_seed(7)
    decades = 3.0 if structure == "kron" else 6.0

    def spectrum(n):
        return torch.logspace(-decades, 0, n, dtype=torch.float64)[torch.randperm(n, generator=gen)]

    out = []
    for k, (c, t) in enumerate(zip(structured_clients(tmp_path, silo, structure), temps)):
        comp = c.components[0]
        blocks = []
        for b in comp.curvature.blocks:
            tensors = {}
            for name, raw in b.to_tensors().items():
                side = raw.shape[0]
                if raw.ndim == 1:
                    tensors[name] = spectrum(side).float()
                else:
                    Q, _ = torch.linalg.qr(torch.randn(side, side, generator=gen, dtype=torch.float64))
                    tensors[name] = (Q @ torch.diag(spectrum(side)) @ Q.T).float()
            enc = ENCODINGS[b.kind]
            blocks.append(enc.decode(tensors, {**enc.header(b), "size": b.dim}))
        new = Component(0, comp.map, BlockDiag(blocks), comp.training, t, comp.prior_precision)
        path = tmp_path / f"six{k}.h5"
        write_client_artifact(path, c.model_spec, c.layout, dict(c.metadata, temperature=t), [new])
        out.append(posterior_fusion.load(path))
    return out


@pytest.mark.parametrize("structure", ["diag", "diag+full", "kron"])
def test_hbfl_default_is_eq_3_8_on_full_rank_curvature_spanning_six_decades(tmp_path, small_silo, structure):
    """HBFL with its default settings (no `null_tol` given) on full-rank curvature whose eigenvalues span six
    decades equals the dense float64 solve of eqs. 3.8–3.12 (the prior divided out exactly) to 1e-5
    relative; the soft projector at the former default 1e-6 does not (so the test tells the two apart)."""
    clients = _six_decade_clients(tmp_path, small_silo, structure)
    settings = HBFLSettings(prior_scale=0.0, solver="exact")
    got = hbfl(FusionInputs(clients, FusionOptions(progress=False)), settings).members[0].double()
    Lam, eta = _paper_dense(clients)
    want = torch.linalg.solve(Lam, eta)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-5, rel
    soft = hbfl(FusionInputs(clients, FusionOptions(progress=False)),
                HBFLSettings(prior_scale=0.0, solver="exact", null_tol=1e-6)).members[0].double()
    assert ((soft - want).norm() / want.norm()).item() > 10 * max(rel, 1e-7)
