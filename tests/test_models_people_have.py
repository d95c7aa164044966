"""The models people have: what the capture cannot take is refused before any training, in one line."""

from __future__ import annotations

from click.testing import CliRunner
from conftest import install_fake_plugin

from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo

TRANSFORMER = '''
import torch
from torch import nn


class TinyTransformer(nn.Module):
    """A stock-PyTorch transformer on 7x7 images: rows as tokens, nn.Embedding positions, one encoder layer."""

    def __init__(self, num_classes: int = 10, width: int = 8):
        super().__init__()
        self.patch = nn.Linear(7, width)
        self.pos = nn.Embedding(7, width)
        self.encoder = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        x = x.reshape(x.shape[0], 7, 7)
        h = self.patch(x) + self.pos(torch.arange(7, device=x.device))[None]
        return self.head(self.norm(self.encoder(h)).mean(1))


def tinytransformer(num_classes: int = 10, width: int = 8) -> nn.Module:
    return TinyTransformer(num_classes, width)
'''


def test_a_stock_transformer_is_refused_before_training_not_after(tmp_path, monkeypatch, small_silo):
    """``nn.TransformerEncoderLayer`` (its ``nn.MultiheadAttention``) under ``--structure kron``: the fast
    capture cannot take it (and never falls back to laplace-torch), and laplace-torch, asked for, refuses its
    parameters; ``fit-local`` says so in one line, exit 2, before the first epoch (no training line), and
    writes nothing."""
    install_fake_plugin(tmp_path, monkeypatch, "ttplug", "0.1", "tinytransformer", TRANSFORMER)
    silo = SiloData(small_silo.x[:64, ::4, ::4].copy(), small_silo.y[:64], "fmnist", 10)
    write_silo(tmp_path / "s.h5", silo)
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "tinytransformer",
                                   "-M", "1", "--epochs", "50", "--structure", "kron", "--out", str(tmp_path / "c.h5")])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "fast capture cannot take" in errors[0] and "nothing was trained" in errors[0], errors
    # asked for laplace-torch, which cannot take nn.MultiheadAttention's parameters: refused the same way
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "tinytransformer",
                                   "-M", "1", "--epochs", "50", "--structure", "kron", "--capture", "laplace",
                                   "--out", str(tmp_path / "c.h5")])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "kron capture (laplace)" in errors[0], r.output
    assert "nothing was trained" in errors[0] and not (tmp_path / "c.h5").exists()
    assert "training" not in r.stderr.replace("nothing was trained", ""), r.stderr
    assert "Traceback" not in r.output and not (tmp_path / "c.h5").exists()


EMBEDDED = '''
import torch
from torch import nn


class Embedded(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.patch = nn.Linear(7, 8)
        self.pos = nn.Embedding(7, 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        h = self.patch(x.reshape(x.shape[0], 7, 7)) + self.pos(torch.arange(7, device=x.device))[None]
        return self.head(torch.relu(h).mean(1))


def embedded(num_classes: int = 10) -> nn.Module:
    return Embedded(num_classes)
'''


def test_a_parameter_without_curvature_is_named_in_a_warning(tmp_path, monkeypatch, small_silo):
    """An ``nn.Embedding`` the fast capture does not cover gets the prior alone: ``fit-local`` names it in one
    warning line and records it as ``prior`` in ``curvature_blocks``."""
    import posterior_fusion

    install_fake_plugin(tmp_path, monkeypatch, "embplug", "0.1", "embedded", EMBEDDED)
    write_silo(tmp_path / "s.h5", SiloData(small_silo.x[:64, ::4, ::4].copy(), small_silo.y[:64], "fmnist", 10))
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "embedded", "-M", "1",
                                   "--epochs", "1", "--out", str(tmp_path / "c.h5")])
    warnings = [line for line in r.stderr.splitlines() if "no curvature, the prior alone" in line]
    assert r.exit_code == 0 and len(warnings) == 1 and "56 parameters of nn.Embedding (pos.weight)" in warnings[0], r.output
    assert posterior_fusion.load(tmp_path / "c.h5").metadata["curvature_blocks"]["pos.weight"] == "prior"
    shown = CliRunner().invoke(pfuse, ["inspect", str(tmp_path / "c.h5")])
    assert shown.exit_code == 0 and "no curvature, the prior alone: pos.weight" in shown.output, shown.output


def test_fit_local_states_the_artifact_size_before_training(tmp_path, small_silo):
    """The header line (before the first epoch) states the artifact's size per component; it matches the
    written artifact's MAP and curvature bytes within 5 % for each structure."""
    import re

    import posterior_fusion
    from posterior_fusion.summary import summarize

    write_silo(tmp_path / "s.h5", SiloData(small_silo.x[:64], small_silo.y[:64], "fmnist", 10))
    for structure in ("kron", "diag", "diag+full"):
        out = tmp_path / f"{structure}.h5"
        r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "lenet", "-M", "1",
                                       "--epochs", "1", "--structure", structure, "--out", str(out)])
        assert r.exit_code == 0, r.output
        header = next(line for line in r.stderr.splitlines() if "artifact about" in line)
        stated = float(re.search(r"artifact about ([0-9.e+-]+) MiB per component", header).group(1)) * 2**20
        comp = summarize(posterior_fusion.load(out))["components"][0]
        actual = comp["curvature_bytes"] + 4 * posterior_fusion.load(out).layout.dim
        assert abs(stated - actual) <= 0.05 * actual, (structure, stated, actual)
