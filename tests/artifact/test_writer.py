"""The artifact writer: what it writes its own reader accepts, and what the reader would refuse it refuses to write."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_META, TINY_SPEC, kron_component

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact, write_global_artifact
from posterior_fusion.artifact.writer import write_predictions
from posterior_fusion.errors import (
    NonFiniteOutputError,
    OutputError,
)
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.posterior import Component


def test_large_metadata_is_written_and_read(tmp_path, kron_artifact):
    art = posterior_fusion.load(kron_artifact)
    history = [[{"step": i, "objective": float(i), "val_accuracy": 0.5} for i in range(3000)]]
    write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"method": "x", "history": history},
                          [art.components[0].map])
    assert len(posterior_fusion.load(tmp_path / "g.h5").metadata["history"][0]) == 3000


def test_writers_refuse_non_finite_numbers_and_name_the_step(tmp_path, kron_artifact):
    art = posterior_fusion.load(kron_artifact)
    c = art.components[0]
    for value, step in ((c.map * float("nan"), "training"),
                        (c.map * 1e39, "training")):
        bad = Component(0, value.float(), c.curvature, c.training, c.temperature, c.prior_precision)
        with pytest.raises(NonFiniteOutputError, match=step):
            write_client_artifact(tmp_path / "c.h5", art.model_spec, art.layout, dict(art.metadata), [bad])
    with pytest.raises(NonFiniteOutputError, match="fusion"):
        write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"method": "x"},
                              [c.map.double() * 1e300])
    with pytest.raises(NonFiniteOutputError, match="metadata.history"):
        write_global_artifact(tmp_path / "g.h5", art.model_spec, art.layout, {"history": [float("inf")]}, [c.map])
    for probs in (torch.full((3, 2), float("nan")), torch.tensor([[-1.0, 2.0]]), torch.tensor([[0.2, 0.2]])):
        with pytest.raises(NonFiniteOutputError, match="not probabilities"):
            write_predictions(tmp_path / "p.h5", probs, {"predictive": "mc"})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_factor_with_a_rounding_negative_diagonal_is_written_so_its_reader_accepts_it(tmp_path):
    """A K-FAC factor whose diagonal holds −1.6e-16 next to near-zero entries (a capture's rounding, as on a
    ResNet-20 layer) is written with that entry at 0 and every other entry as given; the reader accepts it."""
    layout = ParameterLayout.from_model(TINY_SPEC.build())
    g = torch.Generator().manual_seed(0)
    m = torch.randn(6, 2, generator=g)
    A = m @ m.T
    A[5, :] = A[:, 5] = 0.0
    A[5, 5] = -1.58e-16
    B = torch.eye(3) * 2.0
    write_client_artifact(tmp_path / "a.h5", TINY_SPEC, layout, TINY_META, [kron_component(B, A)])
    got = posterior_fusion.load(tmp_path / "a.h5").components[0].curvature.blocks[0].A
    want = A.clone()
    want[5, 5] = 0.0
    assert torch.equal(got, want)


def test_a_writer_never_leaves_a_file_its_reader_refuses(tmp_path):
    """A factor the reader refuses (asymmetric far beyond its tolerance) makes the writer fail in one line
    naming the output and the reader's reason; no file is left, an existing one stays as it was."""
    layout = ParameterLayout.from_model(TINY_SPEC.build())
    A = torch.eye(6)
    A[0, 1] = 5.0  # not symmetric
    out = tmp_path / "a.h5"
    with pytest.raises(OutputError, match=r"a\.h5: not written: its own reader would refuse it \(.*not symmetric"):
        write_client_artifact(out, TINY_SPEC, layout, TINY_META, [kron_component(torch.eye(3), A)])
    assert not out.exists()
    write_client_artifact(out, TINY_SPEC, layout, TINY_META, [kron_component(torch.eye(3), torch.eye(6))])
    before = out.read_bytes()
    with pytest.raises(OutputError):
        write_client_artifact(out, TINY_SPEC, layout, TINY_META, [kron_component(torch.eye(3), A)])
    assert out.read_bytes() == before
    with pytest.raises(OutputError, match="not written"):  # a global member count past the reader's cap
        write_global_artifact(tmp_path / "g.h5", TINY_SPEC, layout, {"method": "fedavg"},
                              [torch.zeros(layout.dim)] * 1025)
    assert not (tmp_path / "g.h5").exists()
