"""Artifact round trip, typed errors on bad input (API and CLI), determinism."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import fit_artifact
from torch.nn.utils import parameters_to_vector

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.artifact.writer import text_attr
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import (
    ArtifactNotFoundError,
    DataError,
    NotAnArtifactError,
    SchemaError,
    UnsupportedVersionError,
    ValueCheckError,
)
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.capture import capture
from posterior_fusion.local.fit_config import TrainConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
from posterior_fusion.posterior import Component


def test_round_trip_predictions_equal_trained_model(tmp_path, small_silo):
    spec = ModelSpec("lenet", {"bias": True})
    torch.manual_seed(0)
    net = spec.build()
    x, y = small_silo.tensors()
    res = train_map(net, x, y, TrainConfig(epochs=1, batch_size=32, weight_decay=0.0, swag=True, swag_rank=3), seed=0)
    comp = Component(0, parameters_to_vector(net.parameters()).detach().clone(), capture("kron", net, x, y)[0],
                     {"final_loss": res.final_loss}, 0.1, 10.0, res.swag)
    meta = {"n_data": len(small_silo), "class_counts": small_silo.class_counts(), "temperature": 0.1,
            "prior_precision": 10.0, "structure": "kron"}
    write_client_artifact(tmp_path / "a.h5", spec, ParameterLayout.from_model(net), meta, [comp])
    art = posterior_fusion.load(tmp_path / "a.h5")
    with torch.no_grad():
        torch.testing.assert_close(art.model(0)(x), net(x), rtol=0, atol=0)
    assert art.structure == "kron" and art.n_data == len(small_silo)
    assert art.components[0].swag.deviations.shape == (3, art.layout.dim)
    for blk_in, blk_out in zip(comp.curvature.blocks, art.components[0].curvature.blocks):
        assert type(blk_in) is type(blk_out)
        for name in ("B", "A", "G", "g"):
            if hasattr(blk_in, name):
                torch.testing.assert_close(getattr(blk_out, name), getattr(blk_in, name), rtol=0, atol=0)


def test_fit_local_is_deterministic(tmp_path, small_silo):
    _, a = fit_artifact(tmp_path / "a.h5", small_silo, "diag", seed=3)
    _, b = fit_artifact(tmp_path / "b.h5", small_silo, "diag", seed=3)
    _, c = fit_artifact(tmp_path / "c.h5", small_silo, "diag", seed=4)
    for ca, cb in zip(a, b):
        torch.testing.assert_close(ca.map, cb.map, rtol=0, atol=0)
        torch.testing.assert_close(ca.curvature.blocks[0].g, cb.curvature.blocks[0].g, rtol=0, atol=0)
    assert not torch.equal(a[0].map, c[0].map)
    # Same init seed: the same starting point per mode on every client (the server's median needs it).
    la, lb = posterior_fusion.load(tmp_path / "a.h5"), posterior_fusion.load(tmp_path / "b.h5")
    assert la.metadata["data_sha256"] == lb.metadata["data_sha256"]


def test_mixture_log_prob_is_logsumexp_of_components(kron_artifact):
    art = posterior_fusion.load(kron_artifact)
    w = art.components[0].map + 0.01
    comps = torch.stack([c.log_prob(w) for c in art.components])
    torch.testing.assert_close(art.log_prob(w), torch.logsumexp(comps, 0) - np.log(len(comps)))
    # Re-tempering on read: a lower temperature sharpens the density away from the mode.
    assert art.components[0].log_prob(w, temperature=0.01) < art.components[0].log_prob(w, temperature=1.0)


# ---------------------------------------------------------------- bad input


def corrupt(src, dst, edit):
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        edit(f)
    return dst


def _nan_factor(f):
    ds = f["/components/0/curvature/0/kron_B"]
    arr = ds[()]
    arr[0, 0] = np.nan
    ds[...] = arr


def _short_map(f):
    del f["/components/1/map"]
    f["/components/1"].create_dataset("map", data=np.zeros(7, np.float32))


def _asym(f):
    ds = f["/components/0/curvature/2/kron_A"]
    arr = ds[()]
    arr[0, 1] += 10 * abs(arr).max()
    ds[...] = arr


def _soft_link(f):
    f["/components/0/extra"] = h5py.SoftLink("/components/0/map")


def _object_dtype(f):
    del f["/components/0/map"]
    f["/components/0"].create_dataset("map", data=np.array(["x"] * 3, dtype=object), dtype=h5py.string_dtype())


def _giant_dataset(f):
    del f["/components/0/map"]
    f["/components/0"].create_dataset("map", shape=(10**9,), dtype="f4", chunks=(1 << 16,))


def _giant_block(f):
    f["/components/0/curvature"].attrs["blocks"] = text_attr(
        '[{"kind": "dense", "offset": 0, "size": 100000}]')


def _untiled(f):
    import json as _json

    blocks = _json.loads(bytes(f["/components/0/curvature"].attrs["blocks"]).decode())
    blocks[1]["offset"] += 1
    f["/components/0/curvature"].attrs["blocks"] = text_attr(_json.dumps(blocks))


def _extra_path(f):
    f["/components/0"].create_dataset("evil", data=np.zeros(3, np.float32))


def _missing_path(f):
    del f["/components/1/curvature"]


def _external_link(f):
    f["/components/0/ext"] = h5py.ExternalLink("/etc/passwd", "/x")


def _compound(f):
    del f["/components/0/map"]
    f["/components/0"].create_dataset("map", shape=(3,), dtype=np.dtype([("a", "f4"), ("b", "f4")]))


def _negative_diag(f):
    ds = f["/components/0/curvature/1/dense"]
    arr = ds[()]
    arr[0, 0] = -1.0
    ds[...] = arr


def _inf_map(f):
    ds = f["/components/0/map"]
    arr = ds[()]
    arr[3] = np.inf
    ds[...] = arr


def _int_version(f):
    f.attrs["format_version"] = text_attr("1")


def _undeclared_component(f):
    f["/components"].create_group("7")


CASES = {
    "giant_dataset": (_giant_dataset, SchemaError, "/components/0/map"),
    "giant_block": (_giant_block, SchemaError, "exceeds the cap"),
    "untiled_layout": (_untiled, SchemaError, "do not tile"),
    "extra_path": (_extra_path, SchemaError, "/components/0/evil"),
    "missing_path": (_missing_path, SchemaError, "/components/1/curvature"),
    "external_link": (_external_link, SchemaError, "ExternalLink"),
    "compound_dtype": (_compound, SchemaError, "dtype"),
    "negative_curvature": (_negative_diag, ValueCheckError, "negative diagonal"),
    "inf_map": (_inf_map, ValueCheckError, "NaN or Inf"),
    "string_version": (_int_version, UnsupportedVersionError, "format_version"),
    "undeclared_component": (_undeclared_component, SchemaError, "/components/7"),
    "wrong_version": (lambda f: f.attrs.__setitem__("format_version", np.int64(99)), UnsupportedVersionError, "format_version"),
    "nan_curvature": (_nan_factor, ValueCheckError, "/components/0/curvature/0/kron_B"),
    "mismatched_shape": (_short_map, SchemaError, "/components/1/map"),
    "asymmetric": (_asym, ValueCheckError, "/components/0/curvature/2/kron_A"),
    "soft_link": (_soft_link, SchemaError, "SoftLink"),
    "object_dtype": (_object_dtype, SchemaError, "dtype"),
    "vlen_string_attr": (lambda f: f.attrs.__setitem__("metadata", "{}"), SchemaError, "fixed-length"),
    "giant_model": (lambda f: f.attrs.__setitem__("model_spec", text_attr('{"name": "mlp", "kwargs": {"in_features": 1048576, "hidden": 1048576}}')), SchemaError, "layout does not match"),
    "unknown_model": (lambda f: f.attrs.__setitem__("model_spec", text_attr('{"name": "resnet", "kwargs": {}}')), SchemaError, "unknown model"),
    "extra_kwarg": (lambda f: f.attrs.__setitem__("model_spec", text_attr('{"name": "mlp", "kwargs": {"hidden": 16, "evil": 1}}')), SchemaError, "evil"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_corrupt_artifact_typed_error_and_cli_line(tmp_path, kron_artifact, case):
    edit, exc_type, needle = CASES[case]
    bad = corrupt(kron_artifact, tmp_path / f"{case}.h5", edit)
    with pytest.raises(exc_type) as info:
        posterior_fusion.load(bad)
    assert needle in str(info.value)
    result = CliRunner().invoke(pfuse, ["inspect", str(bad), "--validate"])
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


def test_missing_not_hdf5_and_truncated(tmp_path, kron_artifact):
    with pytest.raises(ArtifactNotFoundError):
        posterior_fusion.load(tmp_path / "nope.h5")
    (tmp_path / "text.h5").write_text("hello, not hdf5")
    with pytest.raises(NotAnArtifactError):
        posterior_fusion.load(tmp_path / "text.h5")
    raw = kron_artifact.read_bytes()
    for frac in (0.1, 0.5, 0.9):
        (tmp_path / "trunc.h5").write_bytes(raw[: int(len(raw) * frac)])
        with pytest.raises((NotAnArtifactError, SchemaError)):
            posterior_fusion.load(tmp_path / "trunc.h5")
        result = CliRunner().invoke(pfuse, ["inspect", str(tmp_path / "trunc.h5"), "--validate"])
        assert result.exit_code != 0 and len(result.stderr.strip().splitlines()) == 1
    for name in ("nope.h5", "text.h5"):
        result = CliRunner().invoke(pfuse, ["inspect", str(tmp_path / name), "--validate"])
        assert result.exit_code == 2 and result.stderr.startswith("error:")


def test_labels_out_of_range(tmp_path, small_silo):
    y = small_silo.y.copy()
    y[5] = 12
    write_silo(tmp_path / "bad.h5", SiloData(small_silo.x, y, "fmnist", 13))  # the writer refuses labels >= 10
    with h5py.File(tmp_path / "bad.h5", "r+") as f:  # a hostile file: the header says 10 classes
        f.attrs["num_classes"] = 10
    from posterior_fusion.data.silo import read_silo

    with pytest.raises(DataError, match="labels must be in"):
        read_silo(tmp_path / "bad.h5")
    result = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "bad.h5"), "--model", "mlp",
                                        "--epochs", "1", "-M", "1", "--out", str(tmp_path / "o.h5")])
    assert result.exit_code != 0 and "labels must be in" in result.stderr
    assert not (tmp_path / "o.h5").exists()


def test_inspect_json(kron_artifact):
    import json

    result = CliRunner().invoke(pfuse, ["inspect", str(kron_artifact), "--json"])
    assert result.exit_code == 0
    s = json.loads(result.stdout)
    assert s["kind"] == "client" and s["structure"] == "kron" and len(s["components"]) == 2
    assert s["num_params"] == sum(int(np.prod(e["shape"])) for e in s["layout"])
