"""A shared pretrained base: ``pfuse init --from`` (safetensors or a global artifact), its SHA-256 recorded
from the init file through every client artifact to the global, clients of different bases refused."""

from __future__ import annotations

import hashlib

import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from torch.nn.utils import parameters_to_vector

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.models import ModelSpec

KWARGS = '{"in_features": 49, "hidden": 6}'


def _base(tmp_path, seed: int, name: str = "base.safetensors"):
    torch.manual_seed(seed)
    model = ModelSpec("mlp", {"in_features": 49, "hidden": 6}).build()
    path = tmp_path / name
    save_file({k: v.detach().clone() for k, v in model.named_parameters()}, str(path))
    return path, parameters_to_vector(model.parameters()).detach()


def _run(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


def test_init_from_a_safetensors_base_runs_through_fit_local_and_fuse(tmp_path, small_silo):
    """Every starting point is the base exactly; the base's SHA-256 is in the init file, each client
    artifact and the fused global; the prior is centred at the base (stored, shown by inspect) and the
    methods that divide it out fuse such clients; from random starts it stays at zero; clients fine-tuned
    from another base, or from none, are refused."""
    path, w = _base(tmp_path, 0)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "2", "--from", path, "--out", tmp_path / "i.h5")
    assert r.exit_code == 0, r.output
    init = posterior_fusion.load(tmp_path / "i.h5")
    assert init.metadata["base"]["sha256"] == sha and all(torch.equal(m, w) for m in init.members)
    for c in range(2):
        write_silo(tmp_path / f"s{c}.h5", SiloData(small_silo.x[c * 60:(c + 1) * 60, ::4, ::4].copy(),
                                                   small_silo.y[c * 60:(c + 1) * 60], "fmnist", 10))
        r = _run("fit-local", "--data", tmp_path / f"s{c}.h5", "--init", tmp_path / "i.h5", "--epochs", "1",
                 "--structure", "diag", "--train-seed", c, "--out", tmp_path / f"c{c}.h5")
        assert r.exit_code == 0, r.output
        assert posterior_fusion.load(tmp_path / f"c{c}.h5").metadata["init"]["base_sha256"] == sha
        assert torch.equal(posterior_fusion.load(tmp_path / f"c{c}.h5").prior_mean, w)  # the prior centred at it
    r = _run("inspect", tmp_path / "c0.h5")
    assert r.exit_code == 0 and "prior: N(base, 1/λ0)" in r.output, r.output
    r = _run("fuse", tmp_path / "c0.h5", tmp_path / "c1.h5", "--method", "fedavg", "--out", tmp_path / "g.h5")
    assert r.exit_code == 0 and posterior_fusion.load(tmp_path / "g.h5").metadata["base_sha256"] == sha, r.output
    for method in ("product", "fedbens"):  # the methods that divide the prior out at its centre
        r = _run("fuse", tmp_path / "c0.h5", tmp_path / "c1.h5", "--method", method, "--out", tmp_path / f"{method}.h5")
        assert r.exit_code == 0, r.output
    # a fused global as the next base: its first member
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "1", "--from", tmp_path / "g.h5",
             "--out", tmp_path / "i2.h5")
    assert r.exit_code == 0, r.output
    assert torch.equal(posterior_fusion.load(tmp_path / "i2.h5").members[0], posterior_fusion.load(tmp_path / "g.h5").members[0])
    # another base, and no base: refused beside the first client in one line
    other, _ = _base(tmp_path, 1, "other.safetensors")
    _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "2", "--from", other, "--out", tmp_path / "j.h5")
    _run("fit-local", "--data", tmp_path / "s1.h5", "--init", tmp_path / "j.h5", "--epochs", "1", "--structure", "diag",
         "--out", tmp_path / "d1.h5")
    _run("fit-local", "--data", tmp_path / "s1.h5", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "2", "--epochs", "1",
         "--structure", "diag", "--out", tmp_path / "e1.h5")
    assert posterior_fusion.load(tmp_path / "e1.h5").prior_mean is None  # random starts: the prior at zero
    assert "prior: N(0, 1/λ0)" in _run("inspect", tmp_path / "e1.h5").output
    for odd, words in (("d1.h5", "the base"), ("e1.h5", "no pretrained base")):
        r = _run("fuse", tmp_path / "c0.h5", tmp_path / odd, "--method", "fedavg", "--out", tmp_path / "x.h5")
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and odd in lines[0] and words in lines[0], r.output
        assert not (tmp_path / "x.h5").exists()


def test_a_base_that_does_not_fit_the_model_is_one_line(tmp_path):
    """Missing or extra tensors, a wrong shape, an integer tensor, NaN, a file that is not safetensors, a
    global of another model: one line naming the file, exit 2, no init file."""
    model = ModelSpec("mlp", {"in_features": 49, "hidden": 6}).build()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    cases = {
        "missing": ({k: v for k, v in params.items() if k != "3.bias"}, "missing '3.bias'"),
        "extra": ({**params, "running_mean": torch.zeros(6)}, "not parameters 'running_mean'"),
        "shape": ({**params, "1.weight": torch.zeros(6, 48)}, "shape (6, 49)"),
        "integer": ({**params, "1.bias": torch.zeros(6, dtype=torch.int64)}, "float tensor"),
        "nan": ({**params, "3.bias": torch.full((10,), float("nan"))}, "NaN or Inf"),
    }
    for name, (tensors, words) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "--from", path, "--out", tmp_path / "i.h5")
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and path.name in lines[0] and words in lines[0], (name, r.output)
        assert not (tmp_path / "i.h5").exists()
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "--from", junk, "--out", tmp_path / "i.h5")
    assert r.exit_code == 2 and "not a readable safetensors file" in r.stderr, r.output


def test_the_python_api_writes_a_base_from_a_module(tmp_path):
    """``posterior_fusion.write_base(module, path)``: the module's parameters by name, read back by ``init --from``
    as exactly its flat parameter vector; its SHA-256 is the one returned."""
    from posterior_fusion.local.init import read_base

    torch.manual_seed(3)
    model = ModelSpec("mlp", {"in_features": 49, "hidden": 6}).build()
    sha = posterior_fusion.write_base(model, tmp_path / "b.safetensors")
    assert sha == hashlib.sha256((tmp_path / "b.safetensors").read_bytes()).hexdigest()
    _, w, read_sha = read_base(ModelSpec("mlp", {"in_features": 49, "hidden": 6}), tmp_path / "b.safetensors")
    assert read_sha == sha and torch.equal(w, parameters_to_vector(model.parameters()).detach())
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "1", "--from", tmp_path / "b.safetensors",
             "--out", tmp_path / "i.h5")
    assert r.exit_code == 0 and posterior_fusion.load(tmp_path / "i.h5").metadata["base"]["sha256"] == sha
