"""Models at real size: K-FAC-reduce against curvlinops, the layer policy (normalisation
layers' diagonal blocks against a dense per-sample Jacobian reference, other parameters their own GGN
diagonal, BatchNorm's running statistics refused), silos on a device, and a GroupNorm ResNet end to
end through the CLI."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from conftest import dense_ggn_diagonal
from torch import nn

import posterior_fusion
from cli.main import pfuse
from posterior_fusion.data.silo import SiloData
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.fast import fast_diag, fast_diag_vector, fast_kron
from posterior_fusion.local.capture.policy import block_policy
from posterior_fusion.local.fit_config import FitConfig, TrainConfig
from posterior_fusion.models import non_parameter_state
from posterior_fusion.models.layers import unsupported_reason


def convnet() -> nn.Module:
    """Strided, padded and dilated convolutions (weight sharing with every index pattern) and a
    linear layer whose input has an extra position axis (weight sharing in a Linear)."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1, bias=True), nn.Tanh(),
        nn.Conv2d(4, 3, (3, 2), stride=1, padding=(2, 1), dilation=(2, 1), bias=False), nn.Tanh(),
        nn.Flatten(2), nn.Linear(25, 6), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 6, 5))


def _data(n: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 9, 7, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def _factors(curv) -> list[torch.Tensor]:
    return [t for b in curv.blocks for t in b.to_tensors().values()]


@pytest.mark.parametrize("ggn", ["exact", "mc"])
def test_reduce_factors_equal_curvlinops_and_expand_is_unchanged(ggn):
    """K-FAC-reduce and -expand factors of the fast capture equal curvlinops' (through laplace-torch's
    backend, float64) on convolutions with stride, padding and dilation and a weight-shared Linear;
    reduce differs from expand where weights are shared and equals it where they are not."""
    torch.manual_seed(0)
    model = convnet().double().eval()
    x, y = _data()
    assert unsupported_reason(model, x[:2]) is None
    out = {}
    for kfac in ("expand", "reduce"):
        gen = (lambda: torch.Generator().manual_seed(3)) if ggn == "mc" else (lambda: None)
        fast, how = capture("kron", model, x, y, 8, ggn, "fast", gen(), kfac=kfac)
        assert how == "fast"
        out[kfac] = fast
        if ggn == "exact":  # curvlinops' MC labels come from its own generator: compared on the exact GGN
            ref, how = capture("kron", model, x, y, 8, ggn, "laplace", kfac=kfac)
            assert how == "laplace"
            for a, b in zip(_factors(ref), _factors(fast), strict=True):
                assert ((a - b).norm() / a.norm()).item() < 1e-10, kfac
    differs = [((a - b).norm() / a.norm()).item() for a, b in zip(_factors(out["expand"]), _factors(out["reduce"]))]
    # blocks: conv1 (B, A), bias (B), conv2 (B, A), linear 1 (B, A), bias (B), linear 2 (B, A), bias (B)
    assert min(differs[:6]) > 1e-3 and max(differs[8:]) < 1e-12, differs


def test_expand_factors_through_the_shifted_input_gram_equal_curvlinops(monkeypatch):
    """The same model's expand factors with every stride-1 convolution's input factor taken through
    the shifted Gram (forced; the rule picks it for wide layers and large batches) equal curvlinops'."""
    from posterior_fusion.local.capture import inputs

    monkeypatch.setattr(inputs, "_pixel_gram_pays", lambda module, x: False)
    monkeypatch.setattr(inputs, "_shift_gram_pays", lambda module, x: module.stride == (1, 1))
    torch.manual_seed(0)
    model = convnet().double().eval()
    x, y = _data()
    fast, how = capture("kron", model, x, y, 8, "exact", "fast", kfac="expand")
    ref, _ = capture("kron", model, x, y, 8, "exact", "laplace", kfac="expand")
    assert how == "fast"
    for a, b in zip(_factors(ref), _factors(fast), strict=True):
        assert ((a - b).norm() / a.norm()).item() < 1e-10


class Scaled(nn.Module):
    """A parameter outside any known layer (the layer policy gives it the prior alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.gain


def normnet(kind: str) -> nn.Module:
    norm = {"group": lambda: nn.GroupNorm(2, 4), "layer": lambda: nn.LayerNorm([4, 5, 4]),
            "batch": lambda: nn.BatchNorm2d(4)}[kind]()
    return nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), norm, nn.ReLU(), Scaled(), nn.Flatten(),
                         nn.Linear(80, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 5))


@pytest.mark.parametrize("kind", ["group", "layer", "batch"])
def test_layer_policy_blocks_equal_the_dense_reference(kind):
    """GroupNorm, LayerNorm and (evaluation-mode) BatchNorm affine parameters get diagonal blocks equal
    to the exact GGN diagonal of a dense Jacobian reference; a parameter of an unknown module gets a
    zero block (the prior alone); the K-FAC structure keeps Kron/Dense blocks for Linear/Conv2d, the
    policy lists each parameter's kind, and the diag structure equals the reference everywhere else."""
    torch.manual_seed(1)
    model = normnet(kind).double()
    x = torch.randn(16, 2, 9, 7, dtype=torch.float64)
    y = torch.randint(0, 5, (16,))
    if kind == "batch":
        model.train()
        model(x)  # running statistics that are not (0, 1)
        assert "training mode" in unsupported_reason(model)
    model.eval()
    ref = dense_ggn_diagonal(model, x)
    names = [n for n, _ in model.named_parameters()]
    policy = dict(block_policy(model, "kron"))
    assert list(policy) == names
    expected = {"0.weight": "kron", "0.bias": "dense", "1.weight": "diag", "1.bias": "diag", "3.gain": "residual",
                "5.weight": "kron", "5.bias": "dense", "6.weight": "diag", "6.bias": "diag", "8.weight": "kron",
                "8.bias": "dense"}
    assert policy == expected

    sizes = [p.numel() for p in model.parameters()]
    residual = torch.cat([torch.full((s,), k == "residual") for s, k in zip(sizes, expected.values())])
    diag = fast_diag_vector(model, x, y, 5)  # the layer rules' part; the residual parameters left at zero there
    torch.testing.assert_close(diag[~residual], ref[~residual], rtol=1e-10, atol=1e-12)
    assert torch.count_nonzero(diag[residual]) == 0
    whole = fast_diag(model, x, y, 5).blocks[0].diagonal()  # with the residual parameters' own GGN diagonal
    torch.testing.assert_close(whole, ref, rtol=1e-10, atol=1e-12)
    kron = fast_kron(model, x, y, 5)
    assert [b.kind for b in kron.blocks] == [expected[n] if expected[n] != "residual" else "diag" for n in names]
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    for i, kind_ in enumerate(expected.values()):
        block = kron.blocks[i].to_dense().diagonal()
        want = ref[offsets[i] : offsets[i + 1]]
        if kind_ in ("diag", "residual"):
            torch.testing.assert_close(block, want, rtol=1e-10, atol=1e-12)


def test_batchnorm_running_statistics_are_refused_in_one_line(tmp_path):
    bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.LazyLinear(3))
    assert "running_mean" in non_parameter_state(bn) and "GroupNorm" in non_parameter_state(bn)
    assert non_parameter_state(normnet("group")) is None


def test_cuda_device_without_a_gpu_is_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal cannot be observed (test_fit_on_cuda_equals_cpu runs)")
    import numpy as np

    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((30, 6), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.arange(30) % 3)
    r = CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"),
                                   "--out", str(tmp_path / "d.h5")])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "d.h5"), "--model", "mlp", "--device", "cuda",
                                   "--out", str(tmp_path / "a.h5")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "no CUDA device" in r.stderr, r.stderr
    assert not (tmp_path / "a.h5").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("structure,kfac", [("kron", "expand"), ("kron", "reduce"), ("diag+full", "expand")])
def test_fit_on_cuda_equals_cpu(structure, kfac, small_silo):
    """Training and capture on the GPU give the CPU's artifact within float32 rounding."""
    from posterior_fusion.local.fit import fit_components
    from posterior_fusion.local.init import initial_weights
    from posterior_fusion.models import ModelSpec

    spec = ModelSpec("lenet", {})
    silo = SiloData(small_silo.x[:200], small_silo.y[:200], "fmnist", 10)
    out = {}
    for device in ("cpu", "cuda"):
        cfg = FitConfig(structure=structure, kfac=kfac, device=device, train=TrainConfig(epochs=1, batch_size=32))
        out[device] = fit_components(spec, silo, initial_weights(spec, 1, 0), cfg, log=lambda *_: None)[1][0]
    a, b = out["cpu"], out["cuda"]
    assert b.map.device.type == "cpu" and ((a.map - b.map).norm() / a.map.norm()).item() < 1e-4
    for ta, tb in zip(_factors(a.curvature), _factors(b.curvature)):
        assert tb.device.type == "cpu" and ((ta - tb).norm() / ta.norm()).item() < 1e-3


def test_groupnorm_resnet_fits_fuses_and_evaluates_with_reduce(tmp_path, small_silo):
    """A GroupNorm ResNet-20 (width 4) through the CLI with K-FAC-reduce: the artifact records the
    K-FAC type and each parameter's block, fedbens fuses it, evaluate scores it; the fingerprint of an
    expand fit is the one written before ``kfac`` existed (caches keep their keys)."""
    import numpy as np

    x = (small_silo.x[:120].astype(np.float32) / 255.0)[:, None]
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", small_silo.y[:120])
    assert CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"),
                                      "--out", str(tmp_path / "d.h5")]).exit_code == 0
    kw = '{"width": 4, "norm": "group"}'
    arts = []
    for c in range(2):
        arts.append(tmp_path / f"c{c}.h5")
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "d.h5"), "--model", "resnet20",
                                       "--model-kwargs", kw, "-M", "2", "--epochs", "1", "--kfac", "reduce",
                                       "--train-seed", str(c), "--device", "cpu", "--out", str(arts[-1])])
        assert r.exit_code == 0, r.stderr
    art = posterior_fusion.load(arts[0])
    assert art.metadata["kfac"] == "reduce" and art.model_spec.kwargs["in_channels"] == 1
    blocks = art.metadata["curvature_blocks"]
    assert blocks["stem.weight"] == "kron" and blocks["blocks.0.n1.weight"] == "diag" and blocks["fc.bias"] == "dense"
    assert [b.kind for b in art.components[0].curvature.blocks].count("diag") == sum(v == "diag" for v in blocks.values())
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, arts), "--method", "fedbens", "--set", "steps=5",
                                   "--out", str(tmp_path / "g.h5")])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(pfuse, ["evaluate", str(tmp_path / "g.h5"), "--data", str(tmp_path / "d.h5"), "--json"])
    assert r.exit_code == 0, r.stderr
    assert FitConfig().fingerprint_dict().keys() == FitConfig(kfac="expand", device="cuda").fingerprint_dict().keys()
    assert "kfac" not in FitConfig().fingerprint_dict() and FitConfig(kfac="reduce").fingerprint_dict()["kfac"] == "reduce"


def _spectrum_psd(D: int, decay: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    return (Q * (decay ** torch.arange(D, dtype=torch.float64))) @ Q.T


@pytest.mark.parametrize("budget", [0.01, 0.1, 0.3])
def test_lowrank_truncation_error_is_the_true_error_and_the_rank_is_minimal(budget):
    from posterior_fusion.curvature.truncation import rebuild, truncate

    F = _spectrum_psd(40, 0.8, 0)
    U, lam, sigma, err = truncate(F, budget)
    approx = rebuild(U, lam, sigma, torch.float64)
    true = ((F - approx).norm() / F.norm()).item()
    assert abs(err - true) < 1e-12 and err <= budget
    assert abs(torch.trace(approx) - torch.trace(F)) < 1e-10  # the isotropic remainder keeps the trace
    r = lam.numel()
    if r > 0:  # one rank less misses the budget
        lam_all = torch.linalg.eigvalsh(F).flip(0)
        tail = lam_all[r - 1 :]
        assert ((tail - tail.mean()).square().sum().sqrt() / F.norm()).item() > budget


@pytest.mark.parametrize("budget", [0.02, 0.2])
def test_precision_metric_bounds_every_eigenvalue_of_the_precision(budget):
    """``compress_metric = precision``: every eigenvalue of the rebuilt precision ``(s/T) B̃ ⊗ Ã + λ0 I`` is
    within the budget (per factor, so 2·budget + budget² for both) of the plain one's — a dense float64
    eigen-decomposition, matched through the shared eigenvectors; the recorded error is the worst
    per-factor ratio; one rank less misses the budget at any isotropic level."""
    from posterior_fusion.curvature.compressed import CompressedKron
    from posterior_fusion.curvature.kron import Kron
    from posterior_fusion.curvature.truncation import rebuild, truncate

    B, A = _spectrum_psd(6, 0.3, 1), _spectrum_psd(9, 0.5, 2)
    scale, T, lam0 = 3.0, 0.1, 2.0
    prior = lam0 * T
    block = Kron(B, A, scale=scale)

    def spectrum(Bf, Af):
        return torch.linalg.eigvalsh(torch.kron(Bf, Af) * scale / T + lam0 * torch.eye(54, dtype=torch.float64))

    exact = spectrum(B, A)
    c = CompressedKron.from_kron(block, budget, prior)
    Bt, At = rebuild(c.UB, c.lB, c.sB, torch.float64), rebuild(c.UA, c.lA, c.sA, torch.float64)
    # the rebuilt factors share F's eigenvectors: compare eigenvalue by eigenvalue in that basis
    lb, QB = torch.linalg.eigh(B)
    la, QA = torch.linalg.eigh(A)
    approx_b, approx_a = torch.diagonal(QB.T @ Bt @ QB), torch.diagonal(QA.T @ At @ QA)
    true = torch.outer(lb, la).flatten() * scale / T + lam0
    rebuilt = torch.outer(approx_b, approx_a).flatten() * scale / T + lam0
    worst = ((rebuilt - true).abs() / true).max().item()
    assert worst <= 2 * budget + budget**2 + 1e-9
    assert torch.allclose(torch.sort(true).values, exact, rtol=1e-10)
    one_left = truncate(torch.diag(torch.tensor([3.0, 2.0, 1.0 + 1e-12], dtype=torch.float64)), 1e-20, 0.7)
    assert one_left[3] >= 0.0  # rounding never records a negative error (the reader refuses one)
    sigmas = (c.sB, c.sA)
    for k, (F, other_top) in enumerate(((B, la.max()), (A, lb.max()))):
        r, err, floor = (c.lB, c.lA)[k].numel(), c.errors[k], prior / (scale * other_top.item())
        vals = torch.linalg.eigvalsh(F).flip(0)
        tail = vals[r:]
        recorded_is_true = ((tail - sigmas[k]).abs() / (tail + floor)).max().item() if len(tail) else 0.0
        assert abs(err - recorded_is_true) < 1e-9 and err <= budget
        if r > 0:  # keeping one eigenvalue fewer breaks the budget, whatever the isotropic level
            tail = vals[r - 1 :]
            levels = torch.linspace(tail.min().item(), tail.max().item(), 4001, dtype=torch.float64)
            best = ((tail[None] - levels[:, None]).abs() / (tail[None] + floor)).max(1).values.min().item()
            assert best > budget


def test_compressed_artifacts_record_their_error_fuse_and_shrink(tmp_path, small_silo):
    """The same components written plain and compressed: the header's per-factor error equals the
    true relative Frobenius error of the rebuilt factor against the plain one, quadratic forms of the
    read blocks equal the dense reconstruction, the file is smaller, and fedbens fuses compressed
    artifacts end to end."""
    import json

    import h5py

    from posterior_fusion.artifact import write_client_artifact
    from posterior_fusion.curvature import Kron
    from posterior_fusion.curvature.compressed import Compression
    from posterior_fusion.layout import ParameterLayout
    from posterior_fusion.local.fit import fit_components
    from posterior_fusion.local.init import initial_weights
    from posterior_fusion.models import ModelSpec

    spec = ModelSpec("lenet", {})
    layout = ParameterLayout.from_model(spec.build())
    paths = {}
    for c in range(2):
        silo = SiloData(small_silo.x[c * 150 : (c + 1) * 150], small_silo.y[c * 150 : (c + 1) * 150], "fmnist", 10)
        cfg = FitConfig(train_seed=c, compress=0.1, train=TrainConfig(epochs=1, batch_size=32))
        meta, comps = fit_components(spec, silo, initial_weights(spec, 2, 0), cfg, log=lambda *_: None)
        assert meta["compress"] == 0.1
        for budget in (0.0, 0.1):
            paths[c, budget] = tmp_path / f"c{c}_{budget}.h5"
            write_client_artifact(paths[c, budget], spec, layout, meta, comps, Compression(budget, "frobenius"))
    plain, small = posterior_fusion.load(paths[0, 0.0]), posterior_fusion.load(paths[0, 0.1])
    with h5py.File(paths[0, 0.1]) as f:
        header = json.loads(f["components/0/curvature"].attrs["blocks"])
    assert [h["kind"] for h in header] == ["kron_lowrank"] * 5
    gen = torch.Generator().manual_seed(0)
    for h, pb, cb in zip(header, plain.components[0].curvature.blocks, small.components[0].curvature.blocks):
        assert isinstance(cb, Kron)
        for side, err in zip("BA", h["error"]):
            a, b = getattr(pb, side).double(), getattr(cb, side).double()
            assert abs(((a - b).norm() / a.norm()).item() - err) < 1e-5 and err <= 0.1
        lam = cb.precision(0.1, 10.0)
        v = torch.randn(3, lam.dim, generator=gen, dtype=torch.float32)
        B, A = cb.B.double(), cb.A.double()  # the rebuilt factors, float64
        if lam.dim <= 3000:  # the dense Kronecker matrix (7.5 GB for the 30,720-parameter layer: not formed)
            dense = (0.1 ** -1) * torch.kron(B, A) + 10.0 * torch.eye(lam.dim, dtype=torch.float64)
            want = torch.einsum("ki,ij,kj->k", v.double(), dense, v.double())
        else:  # vec(V)ᵀ (B ⊗ A) vec(V) = ⟨V, B V Aᵀ⟩ from the rebuilt factors
            V = v.double().reshape(3, *cb.shape)
            want = (0.1 ** -1) * (V * (B @ V @ A.T)).sum((1, 2)) + 10.0 * V.square().sum((1, 2))
        torch.testing.assert_close(lam.quadratic_form(v).double(), want, rtol=1e-4, atol=1e-3)
    assert paths[0, 0.1].stat().st_size < paths[0, 0.0].stat().st_size
    # the server evaluates the compact form (no D x D factor) and gets the objective of the rebuilt factors
    import dataclasses

    from posterior_fusion.curvature import BlockDiag, CompressedKron
    from posterior_fusion.fusion.methods.fedbens import GlobalLogPosterior

    compact = [posterior_fusion.load(paths[c, 0.1]) for c in range(2)]
    assert all(isinstance(b, CompressedKron) for b in compact[0].components[0].curvature.blocks)
    rebuilt = [dataclasses.replace(cl, components=tuple(
        dataclasses.replace(comp, curvature=BlockDiag([Kron(b.B, b.A) for b in comp.curvature.blocks]))
        for comp in cl.components)) for cl in compact]
    W = torch.stack([c.map for cl in compact for c in cl.components])[:3]
    values = [GlobalLogPosterior(cls, [0.1, 0.1], [10.0, 10.0], 10.0, torch.float64)(W.double()) for cls in (compact, rebuilt)]
    torch.testing.assert_close(values[0], values[1], rtol=1e-9, atol=1e-6)
    # every method that reads Kronecker factors gives on compressed artifacts what it gives on plain
    # artifacts holding the rebuilt factors
    from posterior_fusion.fusion import fuse

    plain_rebuilt = []
    for c, cl in enumerate(rebuilt):
        plain_rebuilt.append(tmp_path / f"rebuilt_{c}.h5")
        write_client_artifact(plain_rebuilt[-1], spec, layout, dict(cl.metadata), list(cl.components))
    for method, settings in (("fedbens", {"steps": 5}), ("fisher-merge", {}), ("fedfisher", {}), ("regmean", {}),
                             ("fedavg", {})):
        got = fuse([paths[0, 0.1], paths[1, 0.1]], method, settings=settings)[1]
        want = fuse(plain_rebuilt, method, settings=settings)[1]
        for a, b in zip(got.members, want.members, strict=True):
            rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
            assert rel < 1e-4, (method, rel)
    r = CliRunner().invoke(pfuse, ["fuse", str(paths[0, 0.1]), str(paths[1, 0.1]), "--method", "fedbens",
                                   "--set", "steps=5", "--out", str(tmp_path / "g.h5")])
    assert r.exit_code == 0, r.stderr


def test_weighted_sums_share_the_grams_and_match_the_dense_nearest_kronecker():
    """The Laplace step's Kronecker combination for K modes at once equals K single calls, and its
    recorded error is the true relative Frobenius error against the dense float64 sum."""
    from posterior_fusion.curvature import Kron

    g = torch.Generator().manual_seed(0)
    blocks = [Kron(_spectrum_psd(4, 0.5, s).float(), _spectrum_psd(6, 0.7, 10 + s).float()) for s in range(5)]
    W = torch.rand(3, 5, generator=g, dtype=torch.float64)
    many = Kron.weighted_sums(blocks, W)
    for w, (block, err) in zip(W, many):
        one, err1 = Kron.weighted_sum(blocks, w)
        torch.testing.assert_close(block.B, one.B) and torch.testing.assert_close(block.A, one.A)
        T = sum(float(wn) * torch.kron(b.B.double(), b.A.double()) for wn, b in zip(w, blocks))
        true = ((T - torch.kron(block.B, block.A)).norm() / T.norm()).item()
        assert abs(true - err) < 1e-9 and abs(err1 - err) < 1e-12


def test_factor_gram_in_bounded_chunks_equals_the_dense_gram():
    """The Laplace step's Gram of N factors ⟨F_n, F_m⟩, over column chunks of a bounded float64 block
    (here 1, 3 and 7 columns of 30 entries: ragged last chunks), equals the dense float64 Gram."""
    from posterior_fusion.curvature.kron import _gram

    g = torch.Generator().manual_seed(1)
    factors = [torch.randn(5, 6, generator=g) for _ in range(4)]
    X = torch.stack([f.reshape(-1).double() for f in factors])
    for cols in (1, 3, 7, 1000):
        torch.testing.assert_close(_gram(factors, max_bytes=8 * 4 * cols), X @ X.T, rtol=1e-12, atol=1e-12)


def test_a_broken_laplace_install_is_one_line_and_the_fast_path_never_imports_it(tmp_path, monkeypatch):
    """laplace-torch failing to import (as with a torchvision built for another torch) leaves the
    default path working and turns `--capture laplace` into one `error:` line naming the fix."""
    import sys

    import numpy as np

    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((40, 6), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.arange(40) % 3)
    assert CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"),
                                      "--out", str(tmp_path / "d.h5")]).exit_code == 0
    for name in [m for m in sys.modules if m == "laplace" or m.startswith("laplace.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "laplace", None)  # `import laplace` now raises ImportError
    base = ["fit-local", "--data", str(tmp_path / "d.h5"), "--model", "mlp", "-M", "1", "--epochs", "1"]
    r = CliRunner().invoke(pfuse, [*base, "--out", str(tmp_path / "a.h5")])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(pfuse, [*base, "--capture", "laplace", "--out", str(tmp_path / "b.h5")])
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "torchvision" in errors[0] and "Traceback" not in r.stderr
    assert "training" not in r.stderr  # refused before any work


@pytest.mark.parametrize("ggn", ["exact", "mc"])
def test_memory_bounded_capture_passes_change_nothing(monkeypatch, ggn):
    """The capture splits a batch into passes whose kept activations fit PASS_BYTES: one sample per
    pass gives the same factors (and, for MC, the same sampled labels) as one pass for the batch."""

    from posterior_fusion.local.capture import sizing

    model = convnet().double().eval()
    x, y = _data(30)
    one = fast_kron(model, x, y, 30, ggn, torch.Generator().manual_seed(0), kfac="reduce")
    monkeypatch.setattr(sizing, "PASS_BYTES", 1)
    assert sizing.pass_size(model, x, 30) == 1
    many = fast_kron(model, x, y, 30, ggn, torch.Generator().manual_seed(0), kfac="reduce")
    for a, b in zip(_factors(one), _factors(many)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_capture_passes_on_a_gpu_take_a_share_of_its_free_memory(monkeypatch):
    """On a GPU a pass may keep GPU_PASS_SHARE of the memory free there (not the CPU's PASS_BYTES, which
    left an H200 waiting on launches of 20-sample passes); on the CPU the host bound stays. Sample counts
    follow from the same per-sample estimate either way."""

    from posterior_fusion.local.capture import sizing
    from posterior_fusion.models import jacobians

    free = {"bytes": 8 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 2**30))
    assert sizing.pass_bytes(torch.device("cuda")) == 2 * 2**30
    assert sizing.pass_bytes(torch.device("cpu")) == sizing.PASS_BYTES == 384 * 2**20
    free["bytes"] = 2**20  # a nearly full GPU: passes shrink (to one sample), never beyond the free share
    assert sizing.pass_bytes(torch.device("cuda")) == 2**18
    model = convnet().double().eval()
    x, _ = _data(30)
    per_sample = 2 * sum(jacobians.output_bytes(model, x[:1]))
    monkeypatch.setattr(sizing, "PASS_BYTES", 5 * per_sample)
    assert sizing.pass_size(model, x, 30) == 5  # x on the CPU: the host bound


def test_warnings_are_one_line(tmp_path):
    """A library warning (SWAG with fewer snapshots than its rank) reaches the terminal as one
    `warning:` line, without Python's category path and source line."""
    import subprocess
    import sys

    import numpy as np

    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((40, 6), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.arange(40) % 3)
    run = [sys.executable, "-c", "from posterior_fusion.cli.main import main; main()"]
    subprocess.run([*run, "import-data", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"),
                    "--out", str(tmp_path / "d.h5")], check=True, capture_output=True)
    r = subprocess.run([*run, "fit-local", "--data", str(tmp_path / "d.h5"), "--model", "mlp", "-M", "1", "--epochs",
                        "1", "--swag", "--out", str(tmp_path / "a.h5")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "SWAG collected" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: SWAG collected"), r.stderr
    assert "UserWarning" not in r.stderr and "warnings.warn" not in r.stderr


def test_hostile_compressed_blocks_are_one_line(tmp_path):
    """A kron_lowrank block whose header or data lies (rank beyond the side, negative isotropic level,
    vectors that are not orthonormal, values below the isotropic level) is refused in one line."""
    import json

    import h5py

    from posterior_fusion.artifact import write_client_artifact
    from posterior_fusion.artifact.writer import text_attr
    from posterior_fusion.curvature import BlockDiag, Kron
    from posterior_fusion.curvature.compressed import Compression
    from posterior_fusion.layout import ParameterLayout
    from posterior_fusion.models import ModelSpec
    from posterior_fusion.posterior import Component, frozen_mapping

    spec = ModelSpec("mlp", {"in_features": 6, "num_classes": 3, "hidden_sizes": [], "bias": False})
    layout = ParameterLayout.from_model(spec.build())
    g = torch.Generator().manual_seed(0)
    B, A = (lambda X: X @ X.T)(torch.randn(3, 3, generator=g)), (lambda X: X @ X.T)(torch.randn(6, 6, generator=g))
    comp = Component(0, torch.randn(18, generator=g), BlockDiag([Kron(B, A)]), frozen_mapping({"seed": 0}), 0.1, 10.0)
    meta = {"n_data": 10, "class_counts": [3, 3, 4], "temperature": 0.1, "prior_precision": 10.0, "structure": "kron"}
    good = tmp_path / "good.h5"
    write_client_artifact(good, spec, layout, meta, [comp], Compression(0.3))
    assert CliRunner().invoke(pfuse, ["inspect", str(good), "--validate"]).exit_code == 0

    def broken(name, edit_header=None, edit_data=None):
        path = tmp_path / f"{name}.h5"
        path.write_bytes(good.read_bytes())
        with h5py.File(path, "r+") as f:
            grp = f["components/0/curvature"]
            if edit_header:
                blocks = json.loads(grp.attrs["blocks"])
                edit_header(blocks[0])
                grp.attrs["blocks"] = text_attr(json.dumps(blocks))
            if edit_data:
                edit_data(grp["0"])
        return path

    def scale_vectors(grp):
        grp["lowrank_A_vectors"][...] = 2 * grp["lowrank_A_vectors"][...]

    cases = {"rank": broken("rank", lambda b: b.__setitem__("rank", [9, 1])),
             "isotropic": broken("iso", lambda b: b.__setitem__("isotropic", [-1.0, 0.5])),
             "orthonormal": broken("vectors", edit_data=scale_vectors),
             "isotropic level": broken("values", lambda b: b.__setitem__("isotropic", [b["isotropic"][0], 1e6]))}

    def huge(value):
        def edit(grp):
            for name in ("lowrank_B_values", "lowrank_A_values"):
                grp[name][...] = value
        return edit

    # at the float32 edge: every level and kept eigenvalue 1e37, or one kept eigenvalue 3e38
    cases["curvature too large"] = broken("huge", lambda b: b.__setitem__("isotropic", [1e37, 1e37]), huge(1e37))
    cases["curvature too large "] = broken("edge", edit_data=lambda grp: grp["lowrank_A_values"].__setitem__(0, 3e38))
    for needle, path in cases.items():
        needle = needle.strip()
        r = CliRunner().invoke(pfuse, ["inspect", str(path), "--validate"])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, (needle, r.stderr)


def test_the_default_compression_keeps_every_precision_eigenvalue_within_its_budget(tmp_path):
    """An artifact written with the default compression (``Compression(b)``, ``fit-local --compress b``): every
    eigenvalue of each compressed block's precision ``G/T + λ0 I`` is within ``(1 ± b)²`` of the plain one's, on
    factors whose spectra span nine decades together (T = 0.5, λ0 = 0.01) — a dense float64 reference
    matched through the shared eigenvectors. The Frobenius metric at the same budget moves them far more."""
    from posterior_fusion.artifact import write_client_artifact
    from posterior_fusion.curvature import BlockDiag, Kron
    from posterior_fusion.curvature.compressed import Compression
    from posterior_fusion.curvature.truncation import rebuild, stored_error
    from posterior_fusion.layout import ParameterLayout
    from posterior_fusion.models import ModelSpec
    from posterior_fusion.posterior import Component, frozen_mapping
    from posterior_fusion.summary import summarize

    assert FitConfig().compression.metric == Compression().metric == "precision"
    spec = ModelSpec("mlp", {"in_features": 40, "num_classes": 24, "hidden_sizes": [], "bias": False})
    layout = ParameterLayout.from_model(spec.build())
    g = torch.Generator().manual_seed(0)

    def factor(D, decades):
        Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
        return (Q * torch.logspace(0, -decades, D, dtype=torch.float64)) @ Q.T

    B, A = factor(24, 4.0), factor(40, 5.0)
    T, lam0, budget = 0.5, 0.01, 0.05
    comp = Component(0, torch.randn(960, generator=g), BlockDiag([Kron(B.float(), A.float())]),
                     frozen_mapping({"seed": 0}), T, lam0)
    meta = {"n_data": 120, "class_counts": [5] * 24, "temperature": T, "prior_precision": lam0, "structure": "kron"}
    lb, QB = torch.linalg.eigh(B.float().double())
    la, QA = torch.linalg.eigh(A.float().double())
    plain = torch.outer(lb, la).flatten() / T + lam0
    spread = {}
    for metric in ("precision", "frobenius"):
        path = tmp_path / f"{metric}.h5"
        write_client_artifact(path, spec, layout, meta, [comp], Compression(budget) if metric == "precision"
                              else Compression(budget, "frobenius"))
        c = posterior_fusion.load(path).components[0].curvature.blocks[0]
        Bt, At = rebuild(c.UB, c.lB, c.sB, torch.float64), rebuild(c.UA, c.lA, c.sA, torch.float64)
        got = torch.outer(torch.diagonal(QB.T @ Bt @ QB), torch.diagonal(QA.T @ At @ QA)).flatten() / T + lam0
        ratio = got / plain
        spread[metric] = (float(ratio.min()), float(ratio.max()))
        # what `inspect` reports: the error in the precision metric fusion sees, per factor — the recorded one,
        # or for the Frobenius record an upper bound on the dense float64 error in that metric
        (row,) = summarize(posterior_fusion.load(path))["compression"]
        floors = (lam0 * T / float(la[-1]), lam0 * T / float(lb[-1]))
        actual = [stored_error(F.float().double(), U.double(), lam.double(), s, floor) for F, U, lam, s, floor in
                  ((B, c.UB, c.lB, c.sB, floors[0]), (A, c.UA, c.lA, c.sA, floors[1]))]
        assert row["name"] == "1.weight" and row["metric"] == metric and row["recorded"] == list(c.errors)
        if metric == "precision":
            assert row["precision_metric"] == list(c.errors) and not row["precision_metric_is_bound"]
            assert actual == pytest.approx(list(c.errors), rel=1e-3, abs=1e-9)
        else:
            assert row["precision_metric_is_bound"]
            assert all(bound >= a * (1 - 1e-9) for bound, a in zip(row["precision_metric"], actual)), (row, actual)
            assert max(actual) > 10 * budget  # the Frobenius budget does not bound what fusion sees
        text = CliRunner().invoke(pfuse, ["inspect", str(path), "--validate"])
        assert text.exit_code == 0 and "1.weight" in text.output and "precision B" in text.output, text.output
    lo, hi = spread["precision"]
    assert (1 - budget) ** 2 - 1e-6 <= lo and hi <= (1 + budget) ** 2 + 1e-6, spread
    assert spread["frobenius"][0] < 0.5 or spread["frobenius"][1] > 2, spread
