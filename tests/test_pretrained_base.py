"""A shared pretrained base: ``pfuse init --base`` (safetensors or a global artifact), its SHA-256 recorded
from the init file through every client artifact to the global, clients of different bases refused."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from torch.nn.utils import parameters_to_vector

import posterior_fusion
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.models import ModelSpec

KWARGS = '{"in_features": 49, "hidden": 6}'


def _base(tmp_path, seed: int, name: str = "base.safetensors", kwargs: str = KWARGS):
    torch.manual_seed(seed)
    model = ModelSpec("mlp", json.loads(kwargs)).build()
    path = tmp_path / name
    save_file({k: v.detach().clone() for k, v in model.named_parameters()}, str(path))
    return path, parameters_to_vector(model.parameters()).detach()


def _run(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


def _fit_two_silos(tmp_path, small_silo) -> range:
    """Silos ``s0.h5``, ``s1.h5`` (60 images each, 7×7) fitted from ``i.h5`` into ``c0.h5``, ``c1.h5`` (diag)."""
    for c in range(2):
        write_silo(tmp_path / f"s{c}.h5", SiloData(small_silo.x[c * 60:(c + 1) * 60, ::4, ::4].copy(),
                                                   small_silo.y[c * 60:(c + 1) * 60], "fmnist", 10))
        r = _run("fit-local", "--data", tmp_path / f"s{c}.h5", "--init", tmp_path / "i.h5", "--epochs", "1",
                 "--structure", "diag", "--train-seed", c, "--out", tmp_path / f"c{c}.h5")
        assert r.exit_code == 0, r.output
    return range(2)


def test_init_from_a_safetensors_base_runs_through_fit_local_and_fuse(tmp_path, small_silo):
    """Every starting point is the base exactly; the base's SHA-256 is in the init file, each client
    artifact and the fused global; the prior is centred at the base (stored, shown by inspect) and the
    methods that divide it out fuse such clients; from random starts it stays at zero; clients fine-tuned
    from another base, or from none, are refused."""
    path, w = _base(tmp_path, 0)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "2", "--base", path, "--out", tmp_path / "i.h5")
    assert r.exit_code == 0, r.output
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "2", "--from", path, "--out", tmp_path / "o.h5")
    assert r.exit_code == 0 and "warning: --from is deprecated" in r.stderr and "--base" in r.stderr, r.output
    old = posterior_fusion.load(tmp_path / "o.h5")  # the old spelling: the same starting points
    assert old.metadata["base"] == posterior_fusion.load(tmp_path / "i.h5").metadata["base"]
    assert all(torch.equal(m, w) for m in old.members)
    init = posterior_fusion.load(tmp_path / "i.h5")
    assert init.metadata["base"]["sha256"] == sha and all(torch.equal(m, w) for m in init.members)
    for c in _fit_two_silos(tmp_path, small_silo):
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
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "1", "--base", tmp_path / "g.h5",
             "--out", tmp_path / "i2.h5")
    assert r.exit_code == 0, r.output
    assert torch.equal(posterior_fusion.load(tmp_path / "i2.h5").members[0], posterior_fusion.load(tmp_path / "g.h5").members[0])
    # another base, and no base: refused beside the first client in one line
    other, _ = _base(tmp_path, 1, "other.safetensors")
    _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "2", "--base", other, "--out", tmp_path / "j.h5")
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
        r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "--base", path, "--out", tmp_path / "i.h5")
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and path.name in lines[0] and words in lines[0], (name, r.output)
        assert not (tmp_path / "i.h5").exists()
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "--base", junk, "--out", tmp_path / "i.h5")
    assert r.exit_code == 2 and "not a readable safetensors file" in r.stderr, r.output


def test_the_python_api_writes_a_base_from_a_module(tmp_path):
    """``posterior_fusion.write_base(module, path)``: the module's parameters by name, read back by ``init --base``
    as exactly its flat parameter vector; its SHA-256 is the one returned."""
    from posterior_fusion.local.init import read_base

    torch.manual_seed(3)
    model = ModelSpec("mlp", {"in_features": 49, "hidden": 6}).build()
    sha = posterior_fusion.write_base(model, tmp_path / "b.safetensors")
    assert sha == hashlib.sha256((tmp_path / "b.safetensors").read_bytes()).hexdigest()
    _, w, read_sha = read_base(ModelSpec("mlp", {"in_features": 49, "hidden": 6}), tmp_path / "b.safetensors")
    assert read_sha == sha and torch.equal(w, parameters_to_vector(model.parameters()).detach())
    r = _run("init", "--model", "mlp", "--model-kwargs", KWARGS, "-M", "1", "--base", tmp_path / "b.safetensors",
             "--out", tmp_path / "i.h5")
    assert r.exit_code == 0 and posterior_fusion.load(tmp_path / "i.h5").metadata["base"]["sha256"] == sha


def test_a_fused_member_far_from_every_client_warns_at_fusion_and_evaluate_refuses_its_overflow(tmp_path, small_silo,
                                                                                                  monkeypatch):
    """A member more than FAR_FACTOR times farther from the prior centre (the base) than the farthest client MAP:
    fuse warns once and records ``far_members`` in the global; members near the clients record nothing. A
    member whose logits overflow: ``evaluate`` refuses in one line naming the global (exit 2) instead of a NaN
    NLL, and the API's metrics count the non-finite inputs."""
    import warnings

    from posterior_fusion.artifact import load_client
    from posterior_fusion.data.silo import read_silo
    from posterior_fusion.fusion import from_posteriors
    from posterior_fusion.fusion.from_posteriors import FAR_FACTOR, far_members, fuse_clients, write_fused
    from posterior_fusion.fusion.types import FusionInputs, FusionOptions, FusionResult
    from posterior_fusion.metrics import evaluate_members

    deep = '{"in_features": 49, "hidden_sizes": [6, 6, 6]}'  # four layers: a member 1e11 times the base overflows
    path, w = _base(tmp_path, 0, kwargs=deep)
    _run("init", "--model", "mlp", "--model-kwargs", deep, "-M", "2", "--base", path, "--out", tmp_path / "i.h5")
    _fit_two_silos(tmp_path, small_silo)
    clients = [load_client(tmp_path / f"c{c}.h5") for c in range(2)]
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    maps = [comp.map for cl in clients for comp in cl.components]
    reach = max(float((m.double() - w.double()).norm()) for m in maps)
    assert far_members(inputs, FusionResult([m.clone() for m in maps], {})) is None  # the clients themselves
    step = maps[0].double() - w.double()
    near = (w.double() + 0.9 * FAR_FACTOR * reach / step.norm() * step).float()
    far = (w.double() + 1.1 * FAR_FACTOR * reach / step.norm() * step).float()
    assert far_members(inputs, FusionResult([near], {})) is None
    with pytest.warns(UserWarning, match="farther from the base the clients fine-tuned"):
        record = far_members(inputs, FusionResult([near, far], {}))
    assert record["members"] == [1] and abs(record["ratio"][0] - 1.1 * FAR_FACTOR) < 1e-3 * FAR_FACTOR
    assert record["client_reach"] == pytest.approx(reach)

    # the fusion path records it: a method whose member diverges (fedavg's member 1e11 times the base: its logits
    # overflow float32, its weights stay under the reader's bound)
    real = from_posteriors.get_method("fedavg")

    class Diverging:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, inputs, settings):
            res = real(inputs, settings)
            return FusionResult([1e11 * w for _ in res.members], res.info)

    monkeypatch.setattr(from_posteriors, "get_method", lambda name: Diverging())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inputs, res, meta = fuse_clients(clients, "fedavg", FusionOptions(progress=False))
    assert [str(x.message) for x in caught if "farther" in str(x.message)], [str(x.message) for x in caught]
    assert meta["far_members"]["members"] == [0]
    write_fused(tmp_path / "g.h5", inputs, res, meta)
    monkeypatch.undo()

    test = read_silo(tmp_path / "s1.h5", num_classes=10)
    m = evaluate_members(inputs.spec, res.members, test)
    assert m["non_finite_inputs"] == len(test) and m["non_finite_members"] == [0]
    assert evaluate_members(inputs.spec, maps, test)["non_finite_inputs"] == 0
    r = _run("evaluate", tmp_path / "g.h5", "--data", tmp_path / "s1.h5")
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "g.h5" in lines[0] and "far_members" in lines[0], r.output
