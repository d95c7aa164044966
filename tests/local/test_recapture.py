"""``recapture``: another structure at the trained MAPs equals a fresh fit with that structure."""

from __future__ import annotations

import json

import h5py
import pytest
import torch
from click.testing import CliRunner
from conftest import cli, fit_artifact, fit_split, one_error_line

from posterior_fusion.artifact import load_client, write_client_artifact, write_global_artifact
from posterior_fusion.artifact.writer import text_attr
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.local.recapture import recapture
from posterior_fusion.local.refresh import refresh
from posterior_fusion.local.refresh_settings import RefreshPrivacy

EXACT = RefreshPrivacy(refresh_dp_epsilon=None)  # the refresh round without its mechanism (its maths checked here)


def _dense_parts(curvature) -> list[torch.Tensor]:
    """A block-diagonal precision's dense blocks (a diagonal block as its diagonal): the Frobenius norm of
    the whole dense matrix, and of a difference of two with the same blocks, without forming it."""
    return [b.diagonal().double() if b.kind == "diag" else b.to_dense().double() for b in curvature.blocks]


def _same_components(a, b, tol: float = 1e-6) -> None:
    assert len(a) == len(b)
    for ca, cb in zip(a, b):
        assert torch.equal(ca.map, cb.map)
        da, db = _dense_parts(ca.curvature), _dense_parts(cb.curvature)
        assert [t.shape for t in da] == [t.shape for t in db]
        diff = sum((x - y).square().sum() for x, y in zip(da, db)).sqrt()
        assert diff <= tol * sum(y.square().sum() for y in db).sqrt()


@pytest.mark.parametrize("structure", ["diag", "diag+full"])
def test_recaptured_kron_fit_equals_a_fresh_fit(tmp_path, small_silo, kron_artifact, structure):
    fresh_meta, fresh = fit_artifact(tmp_path / "fresh.h5", small_silo, structure, swag=True)
    source = load_client(kron_artifact)
    meta, comps = recapture(source, small_silo, structure, log=lambda *_: None)
    _same_components(comps, fresh)
    # the kron source's curvature is not what came back
    assert comps[0].curvature.dim == fresh[0].curvature.dim
    assert [b.kind for b in source.components[0].curvature.blocks] != [b.kind for b in comps[0].curvature.blocks]
    assert meta["structure"] == structure and meta["recaptured_from"]["structure"] == "kron"
    assert meta["recaptured_from"]["fit_fingerprint"] == source.metadata["fit_fingerprint"] != meta["fit_fingerprint"]
    for c, s in zip(comps, source.components):  # SWAG moments and training records travel with the MAPs
        assert torch.equal(c.swag.deviations, s.swag.deviations)
        assert c.training["seed"] == s.training["seed"]


def test_mc_recapture_draws_the_fresh_fits_labels(tmp_path, small_silo, kron_artifact):
    _, fresh = fit_artifact(tmp_path / "fresh.h5", small_silo, "diag", swag=True, ggn="mc")
    _, comps = recapture(load_client(kron_artifact), small_silo, "diag", ggn="mc", log=lambda *_: None)
    _same_components(comps, fresh)


def _same_factors(a, b) -> bool:
    """Components with equal MAPs and equal curvature block by block (Kronecker blocks by their factors,
    as a LeNet's dense precision would not fit in memory)."""
    same = len(a) == len(b)
    for ca, cb in zip(a, b):
        same &= torch.equal(ca.map, cb.map) and len(ca.curvature.blocks) == len(cb.curvature.blocks)
        for x, y in zip(ca.curvature.blocks, cb.curvature.blocks):
            parts = [(x.B, y.B), (x.A, y.A)] if x.kind == "kron" else [(x.to_dense(), y.to_dense())]
            same &= x.kind == y.kind and all(p.shape == q.shape and torch.allclose(p.double(), q.double(), rtol=1e-6,
                                                                                   atol=1e-9) for p, q in parts)
    return bool(same)


def test_recapture_keeps_the_sources_kfac(tmp_path, small_silo):
    """A K-FAC-reduce artifact recaptures (and refreshes) as reduce unless told otherwise: expand on
    a ResNet costs 2-4x reduce's capture."""
    small = SiloData(small_silo.x[:96], small_silo.y[:96], "fmnist", 10)
    _, fresh = fit_artifact(tmp_path / "reduce.h5", small, "kron", model="lenet", kwargs={}, kfac="reduce")
    _, expand = fit_artifact(tmp_path / "expand.h5", small, "kron", model="lenet", kwargs={})
    source = load_client(tmp_path / "reduce.h5")
    meta, comps = recapture(source, small, "kron", log=lambda *_: None)
    assert meta["kfac"] == "reduce" and _same_factors(comps, fresh)
    meta, comps = recapture(source, small, "kron", kfac="expand", log=lambda *_: None)
    assert meta["kfac"] == "expand" and _same_factors(comps, expand) and not _same_factors(comps, fresh)


def test_cli_recapture_and_a_foreign_silo(tmp_path, small_silo, kron_artifact):
    write_silo(tmp_path / "silo.h5", small_silo)
    out = tmp_path / "diag.h5"
    result = CliRunner().invoke(pfuse, ["recapture", "--artifact", str(kron_artifact), "--data", str(tmp_path / "silo.h5"),
                                        "--structure", "diag", "--out", str(out)])
    assert result.exit_code == 0, result.output
    art = load_client(out)
    assert art.structure == "diag" and art.num_components == 2
    assert torch.equal(art.components[1].map, load_client(kron_artifact).components[1].map)

    other = SiloData(small_silo.x[:200], small_silo.y[:200], "fmnist", 10)
    write_silo(tmp_path / "other.h5", other)
    bad = CliRunner().invoke(pfuse, ["recapture", "--artifact", str(kron_artifact), "--data", str(tmp_path / "other.h5"),
                                     "--structure", "diag", "--out", str(tmp_path / "x.h5")])
    assert bad.exit_code == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "other.h5" in lines[0] and "not the silo" in lines[0]
    assert not (tmp_path / "x.h5").exists()
    same = CliRunner().invoke(pfuse, ["recapture", "--artifact", str(out), "--data", str(tmp_path / "silo.h5"),
                                      "--structure", "kron", "--out", str(out)])
    assert same.exit_code == 2 and "must differ" in same.stderr
    # recapture writes compressed factors with the three compression settings, recorded in the metadata
    small = tmp_path / "small.h5"
    r = CliRunner().invoke(pfuse, ["recapture", "--artifact", str(kron_artifact), "--data", str(tmp_path / "silo.h5"),
                                   "--compress", "0.1", "--compress-metric", "precision", "--compress-vectors", "float16",
                                   "--out", str(small)])
    assert r.exit_code == 0, r.output
    art = load_client(small)
    assert {k: art.metadata.get(k) for k in ("compress", "compress_metric", "compress_vectors")} == {
        "compress": 0.1, "compress_metric": "precision", "compress_vectors": "float16"}
    assert any(b.kind == "kron_lowrank" and b.stored[1] is not None for b in art.components[0].curvature.blocks)
    bad_budget = CliRunner().invoke(pfuse, ["recapture", "--artifact", str(kron_artifact), "--data", str(tmp_path / "silo.h5"),
                                            "--compress", "1.5", "--out", str(tmp_path / "y.h5")])
    assert bad_budget.exit_code == 2 and bad_budget.stderr.count("\n") == 1 and "compress" in bad_budget.stderr


def _dense_ggn_and_gradient(spec, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """Float64 references at ``w``: the GGN Σ_i J_iᵀ (diag p_i − p_i p_iᵀ) J_i ``(d, d)`` from
    per-sample Jacobians, and ∇ Σ_i CE ``(d,)`` — through torch.func, not the capture code."""
    from torch.func import functional_call, jacrev, vmap

    model = spec.build().double()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]

    def logits(flat, xi):
        params, i = {}, 0
        for n, s in zip(names, shapes):
            params[n] = flat[i : i + s.numel()].reshape(s)
            i += s.numel()
        return functional_call(model, params, (xi[None],))[0]

    w = w.double()
    J = vmap(jacrev(logits), in_dims=(None, 0))(w, x.double())                        # (n, classes, d)
    p = torch.softmax(vmap(logits, in_dims=(None, 0))(w, x.double()), -1)            # (n, classes)
    H = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    G = torch.einsum("nkd,nkl,nle->de", J, H, J)
    g = torch.func.grad(lambda v: torch.nn.functional.cross_entropy(vmap(logits, in_dims=(None, 0))(v, x.double()),
                                                                     y, reduction="sum"))(w)
    return G, g


def test_refresh_at_a_global_mode_reproduces_the_dense_ggn_there(tmp_path, small_silo):
    """``pfuse refresh``: at each global member w*, the diag+full curvature equals a dense float64
    GGN taken at w* (not at the local MAP), damped by d (``G + n·d·I``), and each component is the
    Gaussian N(ŵ, Λ_d⁻¹) whose gradient at w*, Λ_d (w* − ŵ), equals the silo's tempered posterior
    gradient g/T + λ w* there (relative 1e-5) for d = 0, 1 and 10."""
    from posterior_fusion.posterior import GlobalEnsemble

    silo = SiloData(small_silo.x[:120], small_silo.y[:120], "fmnist", 10)
    _, comps = fit_artifact(tmp_path / "c.h5", silo, "diag+full", kwargs={"hidden": 4}, mixtures=2, epochs=1)
    source = load_client(tmp_path / "c.h5")
    gen = torch.Generator().manual_seed(5)
    members = tuple(c.map + 0.05 * torch.randn(c.map.numel(), generator=gen) for c in source.components)
    at = GlobalEnsemble("g.h5", "0" * 64, source.model_spec, source.layout, {"method": "fedavg"}, members)
    last = 4 * 10 + 10  # the last Linear (hidden 4 → 10 classes): weight and bias
    n = silo.y.shape[0]
    eye = torch.eye(members[0].numel(), dtype=torch.float64)
    reference = [_dense_ggn_and_gradient(source.model_spec, w, *silo.tensors()) for w in members]
    steps = {}
    for d in (0.0, 1.0, 10.0):
        meta, refreshed = refresh(source, silo, at, "diag+full", log=lambda *_: None, damping=d, privacy=EXACT)
        assert len(refreshed) == 2 and meta["refreshed_at"] == {"file_sha256": "0" * 64, "method": "fedavg",
                                                                "members": 2, "damping": d}
        assert meta["fit_fingerprint"] != source.metadata["fit_fingerprint"]
        for k, (comp, w, (G, g)) in enumerate(zip(refreshed, members, reference)):
            G_d = G + n * d * eye
            blocks = comp.curvature.blocks
            torch.testing.assert_close(blocks[0].to_dense().double().diagonal(), G_d.diagonal()[:-last],
                                       rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(blocks[1].to_dense().double(), G_d[-last:, -last:], rtol=1e-4, atol=1e-6)
            # not the curvature at the local MAP
            assert not torch.allclose(blocks[1].to_dense(), source.components[k].curvature.blocks[1].to_dense(),
                                      rtol=1e-3)
            T, lam = comp.temperature, comp.prior_precision
            stored = comp.curvature.to_dense().double() / T + lam * eye  # the component's own precision
            gaussian_gradient = stored @ (w.double() - comp.map.double())
            silo_gradient = g / T + lam * w.double()
            error = (gaussian_gradient - silo_gradient).norm() / silo_gradient.norm()
            assert error <= 1e-5, (d, k, float(error))
            assert comp.training["gradient_norm"] == pytest.approx(float(g.norm()), rel=1e-4)
            assert comp.training["damping"] == d and comp.training["gain_test"] in ("passed", "failed")
            assert comp.swag is None and comp.student is None and comp.training["refreshed_at_member"] == k
            steps.setdefault(k, []).append(float((w - comp.map).norm()))
    assert all(a > b > c for a, b, c in steps.values()), steps  # damping shortens the step


def test_cli_refresh_round_end_to_end(tmp_path, small_silo):
    """fuse → refresh --at (structure defaults to the source's) → fuse again; a global artifact of
    another model and a client artifact as --at are refused with one line naming the file."""

    paths = fit_split(tmp_path, small_silo, 2, 150, "kron", mixtures=1)
    write_silo(tmp_path / "silo0.h5", SiloData(small_silo.x[:150], small_silo.y[:150], "fmnist", 10))
    runner = CliRunner()
    glob = tmp_path / "g.h5"
    r = runner.invoke(pfuse, ["fuse", *map(str, paths), "--method", "fedavg", "--out", str(glob)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "refreshed.h5"
    r = runner.invoke(pfuse, ["refresh", "--artifact", str(paths[0]), "--data", str(tmp_path / "silo0.h5"),
                              "--at", str(glob), "--refresh-dp-epsilon", "none", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    art = load_client(out)
    assert art.structure == "kron" and art.num_components == 1 and art.metadata["refreshed_at"]["members"] == 1
    r = runner.invoke(pfuse, ["fuse", str(out), str(paths[1]), "--method", "fedbens", "--set", "steps=2",
                              "--out", str(tmp_path / "g2.h5")])
    assert r.exit_code == 0, r.output
    others = fit_split(tmp_path, small_silo, 2, 150, "kron", name="other", kwargs={"hidden": 3}, mixtures=1)
    r = runner.invoke(pfuse, ["fuse", *map(str, others), "--method", "fedavg", "--out", str(tmp_path / "og.h5")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(pfuse, ["recapture", "--artifact", str(paths[0]), "--data", str(tmp_path / "silo0.h5"),
                              "--damping", "0.5", "--out", str(tmp_path / "x.h5")])
    assert r.exit_code == 2 and "--damping" in r.stderr and not (tmp_path / "x.h5").exists()
    # the old spelling `recapture --from A --at G` still runs the refresh round, with one warning
    old = tmp_path / "old.h5"
    r = runner.invoke(pfuse, ["recapture", "--from", str(paths[0]), "--data", str(tmp_path / "silo0.h5"),
                              "--at", str(glob), "--refresh-dp-epsilon", "none", "--out", str(old)])
    assert r.exit_code == 0 and "use `pfuse refresh`" in r.stderr, r.output
    assert [c.map for c in load_client(old).components][0].equal(art.components[0].map)
    for bad, words in ((tmp_path / "og.h5", "different model"), (paths[1], "expected a global artifact")):
        r = runner.invoke(pfuse, ["refresh", "--artifact", str(paths[0]), "--data", str(tmp_path / "silo0.h5"),
                                  "--at", str(bad), "--out", str(tmp_path / "x.h5")])
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and bad.name in lines[0] and words in lines[0], r.output
        assert not (tmp_path / "x.h5").exists()


def _quartic_problem(seed: int = 3, d: int = 6, quartic: float = 0.0):
    """A silo loss L(w) = T·[½ (w−a)ᵀ G (w−a) + c Σ w⁴] with its Hessian-of-the-quadratic H = T·G (the
    'GGN' the capture would store) and its gradient at w*: float64 dense references."""
    from posterior_fusion.curvature.dense import Dense

    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(d, d, generator=gen, dtype=torch.float64)
    G = m @ m.T + 0.5 * torch.eye(d, dtype=torch.float64)
    a = torch.randn(d, generator=gen, dtype=torch.float64)
    w = torch.randn(d, generator=gen, dtype=torch.float64)
    T, lam = 0.7, 0.3

    def loss(v: torch.Tensor) -> float:
        v = v.double()
        return float(T * (0.5 * (v - a) @ G @ (v - a) + quartic * (v ** 4).sum()))

    g = T * (G @ (w - a) + 4 * quartic * w ** 3)
    return Dense(T * G), T * G, g, w, T, lam, loss


def test_step_ratio_is_one_where_the_silo_posterior_is_quadratic():
    """On a loss that is exactly quadratic with Hessian H (stored as the curvature), the quadratic model
    is the posterior: every damped step's gain ratio is 1 (to float rounding)."""
    from posterior_fusion.local.refresh import newton_centre, step_ratio

    curv, _, g, w, T, lam, loss = _quartic_problem()
    for d in (0.0, 0.1, 3.0):
        c = newton_centre(w, curv, g, T, lam, 10, d)
        assert (c - w).norm() > 1e-3
        assert step_ratio(w, c, curv, g, T, lam, loss(w), loss(c)) == pytest.approx(1.0, abs=1e-9)


def test_auto_damping_keeps_the_first_step_the_loss_confirms():
    """``damping="auto"`` against a dense float64 reference on a non-quadratic loss: for each d of the
    grid, Λ_d = (H + n d I)/T + λI, ŵ_d = w* − Λ_d⁻¹ r, ρ_d = [f(w*) − f(ŵ_d)] / −(rᵀs + ½ sᵀ Λ_0 s);
    the chosen d is the first whose ρ reaches the floor, with that centre and ratio; a fixed damping
    returns its own centre and ratio."""
    from posterior_fusion.local.refresh import AUTO_DAMPINGS, RATIO_FLOOR, refresh_centre

    curv, H, g, w, T, lam, loss = _quartic_problem(quartic=10.0)
    n = 10
    eye = torch.eye(w.numel(), dtype=torch.float64)
    r = g / T + lam * w

    def f(v):
        return loss(v) / T + 0.5 * lam * float(v @ v)

    ref = []
    for d in AUTO_DAMPINGS:
        c = w - torch.linalg.solve((H + n * d * eye) / T + lam * eye, r)
        s = c - w
        ref.append((d, c, (f(w) - f(c)) / -(float(r @ s) + 0.5 * float(s @ ((H / T + lam * eye) @ s)))))
    first = next(k for k, (_, _, rho) in enumerate(ref) if rho >= RATIO_FLOOR)
    assert first > 0, "the problem should reject the smallest damping, or the test shows nothing"
    centre, used, ratio = refresh_centre(w, curv, g, T, lam, n, "auto", loss)
    assert used == ref[first][0] and ratio == pytest.approx(ref[first][2], rel=1e-9)
    torch.testing.assert_close(centre, ref[first][1], rtol=1e-10, atol=1e-12)
    centre, used, ratio = refresh_centre(w, curv, g, T, lam, n, AUTO_DAMPINGS[0], loss)
    assert used == AUTO_DAMPINGS[0] and ratio == pytest.approx(ref[0][2], rel=1e-9) and ratio < RATIO_FLOOR


def test_refresh_with_auto_damping_records_its_choice(tmp_path, small_silo):
    """``refresh --damping auto`` on a real model: each component records the damping it kept and
    its gain ratio, recomputed here from the silo's summed loss at w* and at the centre and from a dense
    float64 GGN and gradient at w*; every smaller damping of the grid falls below the floor.
    The CLI refuses a damping that is neither a number >= 0 nor auto in one line, exit 2."""
    from posterior_fusion.curvature.dense import Dense
    from posterior_fusion.local.refresh import AUTO_DAMPINGS, RATIO_FLOOR, newton_centre, step_ratio
    from posterior_fusion.models.members import build_model
    from posterior_fusion.posterior import GlobalEnsemble

    # the images at 7 × 7 (every fourth pixel): d = 250, so the dense float64 GGN and Newton steps are small
    silo = SiloData(small_silo.x[:120, ::4, ::4].copy(), small_silo.y[:120], "fmnist", 10)
    fit_artifact(tmp_path / "c.h5", silo, "diag+full", kwargs={"in_features": 49, "hidden": 4}, mixtures=2, epochs=1)
    source = load_client(tmp_path / "c.h5")
    gen = torch.Generator().manual_seed(5)
    members = tuple(c.map + 0.3 * torch.randn(c.map.numel(), generator=gen) for c in source.components)
    at = GlobalEnsemble("g.h5", "0" * 64, source.model_spec, source.layout, {"method": "fedavg"}, members)
    meta, comps = refresh(source, silo, at, "diag+full", log=lambda *_: None, damping="auto",
                            trust_radius=100.0, privacy=EXACT)  # members 0.3 from the MAPs per weight: beyond the default radius
    assert meta["refreshed_at"]["damping"] == "auto"
    x, y = silo.tensors()

    def loss(v):
        model = build_model(source.model_spec, v.float()).double()
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(x.double()), y, reduction="sum"))

    for comp, w in zip(comps, members):
        used, rho = comp.training["damping"], comp.training["step_ratio"]
        assert used in AUTO_DAMPINGS and rho >= RATIO_FLOOR or used == AUTO_DAMPINGS[-1]
        G_dense, g = _dense_ggn_and_gradient(source.model_spec, w, x, y)
        T, lam, n = comp.temperature, comp.prior_precision, silo.y.shape[0]
        stored = comp.curvature.to_dense().double()  # diag+full: the GGN's diagonal, then its last layer's block
        torch.testing.assert_close(stored.diagonal(), G_dense.diagonal() + n * used, rtol=1e-4, atol=1e-6)
        # the captured curvature without the stored damping: the gain ratio's quadratic model
        G = Dense(stored - n * used * torch.eye(stored.shape[0], dtype=torch.float64))
        assert comp.training["gain_test"] == ("passed" if rho >= RATIO_FLOOR else "failed")
        assert step_ratio(w, comp.map, G, g, T, lam, loss(w), loss(comp.map)) == pytest.approx(rho, abs=2e-3)
        for d in AUTO_DAMPINGS[: AUTO_DAMPINGS.index(used)]:
            c = newton_centre(w, G, g, T, lam, n, d)
            assert step_ratio(w, c, G, g, T, lam, loss(w), loss(c)) < RATIO_FLOOR + 2e-3
    runner = CliRunner()
    write_silo(tmp_path / "silo.h5", silo)
    for bad in ("often", "-1", "nan"):
        r = runner.invoke(pfuse, ["refresh", "--artifact", str(tmp_path / "c.h5"), "--data", str(tmp_path / "silo.h5"),
                                  "--at", str(tmp_path / "c.h5"), "--damping", bad, "--out", str(tmp_path / "x.h5")])
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and "--damping" in lines[0] and bad in lines[0], r.output
        assert not (tmp_path / "x.h5").exists()


def test_a_step_no_damping_confirms_is_said_and_recorded(tmp_path, small_silo, monkeypatch):
    """When no damping of the grid reaches the gain floor (here a floor no ratio reaches), each component
    keeps the largest damping, records ``gain_test = "failed"`` (accepted by the reader), and the log says
    so once per mode in one line."""
    import posterior_fusion.local.refresh as rc
    from posterior_fusion.posterior import GlobalEnsemble

    silo = SiloData(small_silo.x[:120, ::4, ::4].copy(), small_silo.y[:120], "fmnist", 10)
    fit_artifact(tmp_path / "c.h5", silo, "diag", kwargs={"in_features": 49, "hidden": 4}, mixtures=2, epochs=1)
    source = load_client(tmp_path / "c.h5")
    at = GlobalEnsemble("g.h5", "0" * 64, source.model_spec, source.layout, {"method": "fedavg"},
                        tuple(c.map for c in source.components))
    import warnings as warning_module

    monkeypatch.setattr(rc, "RATIO_FLOOR", 1e9)
    with warning_module.catch_warnings(record=True) as caught:
        warning_module.simplefilter("always")
        meta, comps = rc.refresh(source, silo, at, "diag", log=lambda *_: None, damping="auto", privacy=EXACT)
    lines = [str(w.message) for w in caught]
    warnings = [line for line in lines if "does not confirm" in line]
    assert len(warnings) == 2 and all("gain_test = failed" in line for line in warnings), lines
    assert all(c.training["gain_test"] == "failed" and c.training["damping"] == rc.AUTO_DAMPINGS[-1] for c in comps)
    write_client_artifact(tmp_path / "r.h5", source.model_spec, source.layout, meta, comps)
    assert [c.training["gain_test"] for c in load_client(tmp_path / "r.h5").components] == ["failed", "failed"]


def test_recapture_at_refuses_what_the_server_should_not_choose_before_any_capture(tmp_path, small_silo, monkeypatch):
    """``pfuse refresh``: a global with huge (finite) modes, more members than ``-M``'s cap, a member far from
    the silo's own posterior, or a damping out of range is refused in one line, exit 2, before any capture
    (the capture is replaced by one that fails the test), nothing written."""
    import posterior_fusion.local.refresh as rc
    from posterior_fusion.artifact.schema import MAX_COMPONENTS

    silo = SiloData(small_silo.x[:120, ::4, ::4].copy(), small_silo.y[:120], "fmnist", 10)
    fit_artifact(tmp_path / "c.h5", silo, "diag", kwargs={"in_features": 49, "hidden": 4}, mixtures=1, epochs=1)
    write_silo(tmp_path / "s.h5", silo)
    own = load_client(tmp_path / "c.h5")
    w = own.components[0].map

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before the global was checked")

    monkeypatch.setattr(rc, "capture", no_capture)
    cases = {"huge": ([w + 1e30], "weight beyond 1e+12"), "overflow": ([torch.full_like(w, 3e38)], "weight beyond"),
             "many": ([w] * (MAX_COMPONENTS + 1), f"at most {MAX_COMPONENTS}"),
             "large": ([w + 1e6], "beyond the trust radius"),
             "far": ([w + torch.randn(w.numel(), generator=torch.Generator().manual_seed(1))], "trust radius")}
    runner = CliRunner()
    for name, (members, words) in cases.items():
        g = tmp_path / f"{name}.h5"
        write_global_artifact(g, own.model_spec, own.layout, {"method": "fedavg"}, [w] * len(members))
        with h5py.File(g, "r+") as f:  # a server's file, written by other means than this writer
            for i, m in enumerate(members):
                f[f"members/{i}/weights"][...] = m.numpy()
        r = runner.invoke(pfuse, ["refresh", "--artifact", str(tmp_path / "c.h5"), "--data", str(tmp_path / "s.h5"),
                                  "--at", str(g), "--out", str(tmp_path / "x.h5")])
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and g.name in lines[0] and words in lines[0], (name, r.output)
        assert not (tmp_path / "x.h5").exists()
    g = tmp_path / "near.h5"
    write_global_artifact(g, own.model_spec, own.layout, {"method": "fedavg"}, [w])
    for bad in ("1e308", "2e6"):
        r = runner.invoke(pfuse, ["refresh", "--artifact", str(tmp_path / "c.h5"), "--data", str(tmp_path / "s.h5"),
                                  "--at", str(g), "--damping", bad, "--out", str(tmp_path / "x.h5")])
        assert r.exit_code == 2 and "--damping" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    r = runner.invoke(pfuse, ["refresh", "--artifact", str(tmp_path / "c.h5"), "--data", str(tmp_path / "s.h5"),
                              "--at", str(g), "--trust-radius", "inf", "--out", str(tmp_path / "x.h5")])
    assert r.exit_code == 2 and "--trust-radius" in r.stderr, r.output
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("value", ['"abc"', "true", "1e3", "0", "-5"])
def test_a_recapture_source_with_an_ill_typed_batch_size_ends_in_one_line(tmp_path, kron_artifact, small_silo, value):
    bad = tmp_path / "src.h5"
    bad.write_bytes(kron_artifact.read_bytes())
    with h5py.File(bad, "r+") as f:
        meta = json.loads(bytes(f.attrs["metadata"]).decode())
        meta["curvature_batch_size"] = json.loads(value)
        f.attrs["metadata"] = text_attr(json.dumps(meta))
    silo = tmp_path / "s.h5"
    write_silo(silo, small_silo)
    line = one_error_line(cli("recapture", "--artifact", bad, "--data", silo, "--structure", "diag", "--out", tmp_path / "o.h5"))
    assert "curvature_batch_size" in line or "curvature-batch-size" in line
