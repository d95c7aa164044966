"""``capture_dtype = "bfloat16"``: the fast capture's passes under bfloat16 autocast (
lower-precision arithmetic). References: the same capture in float64 (itself tested against
curvlinops in ``test_real_models.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import posterior_fusion
from cli.main import pfuse
from posterior_fusion.errors import ConfigError
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.fast import fast_diag_vector, fast_kron
from posterior_fusion.local.fit_config import FitConfig


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 3 * 3, 16), nn.Tanh(), nn.Linear(16, 5))


def _data(n: int = 64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def _tensors(curv) -> list[torch.Tensor]:
    return [t.double() for b in curv.blocks for t in b.to_tensors().values()]


@pytest.mark.parametrize("kfac", ["expand", "reduce"])
def test_bfloat16_passes_give_factors_near_the_float64_ones_and_stay_psd(kfac):
    """Every Kronecker factor (and bias block) from bfloat16 passes is within 2 % of the float64
    capture's (bfloat16 keeps 8 bits: ~0.4 % per entry); it really ran in bfloat16 (the float32
    capture is 10³× closer); each factor stays positive semi-definite (Grams of rounded vectors)."""
    model, (x, y) = _net(), _data()
    ref = _tensors(fast_kron(model.double(), x.double(), y, 16, "exact", kfac=kfac))
    model.float()
    f32 = _tensors(fast_kron(model, x, y, 16, "exact", kfac=kfac))
    bf = _tensors(fast_kron(model, x, y, 16, "exact", kfac=kfac, compute_dtype=torch.bfloat16))
    err = [((a - b).norm() / a.norm()).item() for a, b in zip(ref, bf, strict=True)]
    err32 = [((a - b).norm() / a.norm()).item() for a, b in zip(ref, f32, strict=True)]
    assert max(err) < 2e-2, err
    assert max(err32) < 1e-3 * max(err), (err32, err)
    for t in bf:
        if t.ndim == 2:
            ev = torch.linalg.eigvalsh(t)
            assert ev.min() >= -1e-9 * ev.max().abs(), ev.min()


def test_bfloat16_diagonal_capture_is_near_the_float64_one():
    model, (x, y) = _net(), _data()
    ref = fast_diag_vector(model.double(), x.double(), y, 16, "exact")
    got = fast_diag_vector(model.float(), x, y, 16, "exact", compute_dtype=torch.bfloat16).double()
    rel = ((ref - got).norm() / ref.norm()).item()
    assert 1e-6 < rel < 2e-2, rel
    assert (got >= 0).all()


def test_capture_dtype_needs_the_fast_capture():
    x, y = _data(8)
    with pytest.raises(ConfigError, match="needs the fast capture"):
        capture("kron", _net(), x, y, 8, "exact", "laplace", capture_dtype="bfloat16")

    class Twice(nn.Module):  # one Linear applied twice per pass: only laplace-torch captures it
        def __init__(self):
            super().__init__()
            self.body, self.head = _net(), nn.Linear(5, 5)

        def forward(self, v):
            return self.head(torch.tanh(self.head(self.body(v))))

    with pytest.raises(ConfigError, match="which this model cannot use"):
        capture("kron", Twice(), x, y, 8, "exact", "fast", capture_dtype="bfloat16")
    with pytest.raises(ConfigError, match="fast capture cannot take"):  # float32: refused too, no fall-back
        capture("kron", Twice(), x, y, 8, "exact", "fast")
    assert capture("kron", Twice(), x, y, 8, "exact", "laplace")[1] == "laplace"  # laplace-torch when asked
    with pytest.raises(ConfigError, match="unknown `capture_dtype`"):
        capture("kron", _net(), x, y, 8, "exact", "fast", capture_dtype="float16")
    with pytest.raises(ConfigError, match="needs the fast capture"):
        FitConfig(capture="laplace", capture_dtype="bfloat16").validate()


def test_fit_local_and_recapture_record_the_capture_dtype(tmp_path):
    """The artifact records ``capture_dtype`` (and its fingerprint changes) only where it is not float32;
    a recapture records its own, not its source's; a refused combination is one line, before training."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.random((40, 6), dtype=np.float32))
    np.save(tmp_path / "y.npy", np.arange(40) % 3)
    data = str(tmp_path / "d.h5")
    r = CliRunner().invoke(pfuse, ["import-data", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"),
                                   "--out", data])
    assert r.exit_code == 0, r.stderr
    arts = {}
    for dtype in ("float32", "bfloat16"):
        arts[dtype] = tmp_path / f"{dtype}.h5"
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", data, "--model", "mlp", "--epochs", "1",
                                       "--capture-dtype", dtype, "--out", str(arts[dtype])])
        assert r.exit_code == 0, r.stderr
    a32, abf = (posterior_fusion.load(arts[d]) for d in ("float32", "bfloat16"))
    assert "capture_dtype" not in a32.metadata and abf.metadata["capture_dtype"] == "bfloat16"
    assert a32.metadata["fit_fingerprint"] != abf.metadata["fit_fingerprint"]
    assert torch.equal(a32.components[0].map, abf.components[0].map)  # training is not affected
    t32, tbf = _tensors(a32.components[0].curvature), _tensors(abf.components[0].curvature)
    assert 0 < max(((a - b).norm() / a.norm()).item() for a, b in zip(t32, tbf)) < 5e-2  # 40 samples: less averaging
    for extra, expected in (([], None), (["--capture-dtype", "bfloat16"], "bfloat16")):
        out = tmp_path / f"re{len(extra)}.h5"
        r = CliRunner().invoke(pfuse, ["recapture", "--artifact", str(arts["bfloat16"]), "--data", data, *extra, "--out", str(out)])
        assert r.exit_code == 0, r.stderr
        assert posterior_fusion.load(out).metadata.get("capture_dtype") == expected
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", data, "--model", "mlp", "--capture", "laplace",
                                   "--capture-dtype", "bfloat16", "--out", str(tmp_path / "no.h5")])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "needs the fast capture" in r.stderr, r.stderr
    assert not (tmp_path / "no.h5").exists()
