"""Fine-tuning part of a shared base (``fit-local --finetune head | last:K | lora:R``): only the trained
parameters and their curvature are stored per component, the frozen weights stay the base's bit for bit
through fit, fusion and reading, the subset's curvature is the full model's GGN block (dense float64
reference), LoRA's adapters are ordinary layers to the capture and a fused adapter merges into W + B A."""

from __future__ import annotations

from pathlib import Path

import h5py
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from torch import nn
from torch.func import functional_call, jacrev
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import posterior_fusion
import posterior_fusion.data.silo
from posterior_fusion.cli.main import pfuse
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import ArtifactError, ModelSpecError
from posterior_fusion.local.capture import capture
from posterior_fusion.local.init import finetune_start, full_base
from posterior_fusion.models import ModelSpec

KW = {"in_features": 49, "hidden_sizes": [6, 5]}
SPEC = ModelSpec("mlp", KW)  # 0: Flatten; 1: Linear 49→6, 3: Linear 6→5, 5: Linear 5→10 (each with a bias)


def _run(*args):
    return CliRunner().invoke(pfuse, [str(a) for a in args])


def _base(tmp_path):
    torch.manual_seed(0)
    model = SPEC.build()
    path = tmp_path / "base.safetensors"
    save_file({k: v.detach().clone() for k, v in model.named_parameters()}, str(path))
    return path, {k: v.detach().clone() for k, v in model.named_parameters()}


def _silos(tmp_path, small_silo, n=2):
    for c in range(n):
        write_silo(tmp_path / f"s{c}.h5", SiloData(small_silo.x[c * 80:(c + 1) * 80, ::4, ::4].copy(),
                                                   small_silo.y[c * 80:(c + 1) * 80], "fmnist", 10))


@pytest.mark.parametrize("finetune, trained", [("head", ["5.weight", "5.bias"]),
                                               ("last:2", ["3.weight", "3.bias", "5.weight", "5.bias"])])
def test_head_and_last_k_store_only_the_trained_parameters_and_keep_the_base_bit_for_bit(
        tmp_path, small_silo, finetune, trained):
    path, base = _base(tmp_path)
    _silos(tmp_path, small_silo)
    assert _run("init", "--model", "mlp", "--model-kwargs", '{"in_features": 49, "hidden_sizes": [6, 5]}', "-M", "2",
                "--base", path, "--out", tmp_path / "i.h5").exit_code == 0
    for c in range(2):
        r = _run("fit-local", "--data", tmp_path / f"s{c}.h5", "--init", tmp_path / "i.h5", "--finetune", finetune,
                 "--structure", "diag", "--epochs", "2", "--train-seed", c, "--out", tmp_path / f"c{c}.h5")
        assert r.exit_code == 0, r.output
    art = posterior_fusion.load(tmp_path / "c0.h5")
    assert art.layout.names == trained and art.model_spec.finetune == finetune
    assert all(comp.map.numel() == sum(base[n].numel() for n in trained) for comp in art.components)
    frozen = [n for n in base if n not in trained]
    with h5py.File(tmp_path / "c0.h5") as f:  # stored once per artifact, the base's bits
        assert torch.equal(torch.from_numpy(f["frozen"][()]), torch.cat([base[n].reshape(-1) for n in frozen]))
        assert f["components/0/map"].shape == (art.layout.dim,)
    assert not torch.equal(art.components[0].map, torch.cat([base[n].reshape(-1) for n in trained]))  # it trained
    for method in ("fedavg", "fedbens", "fisher-merge"):
        r = _run("fuse", tmp_path / "c0.h5", tmp_path / "c1.h5", "--method", method, "--out", tmp_path / f"{method}.h5")
        assert r.exit_code == 0, r.output
        g = posterior_fusion.load(tmp_path / f"{method}.h5")
        model = g.models()[0]
        state = model.state_dict()  # the whole architecture's: the frozen weights back, bit for bit
        assert all(torch.equal(state[n], base[n]) for n in frozen)
        whole = full_base(g.model_spec, g.members[0])
        offsets = torch.cumsum(torch.tensor([0] + [base[n].numel() for n in base]), 0)
        for i, n in enumerate(base):
            if n in frozen:
                assert torch.equal(whole[offsets[i]: offsets[i + 1]], base[n].reshape(-1))
    # the fused model as the next base: all of its weights, the frozen ones the first base's
    r = _run("init", "--model", "mlp", "--model-kwargs", '{"in_features": 49, "hidden_sizes": [6, 5]}', "-M", "1",
             "--base", tmp_path / "fedavg.h5", "--out", tmp_path / "i2.h5")
    assert r.exit_code == 0, r.output
    assert torch.equal(posterior_fusion.load(tmp_path / "i2.h5").members[0],
                       full_base(posterior_fusion.load(tmp_path / "fedavg.h5").model_spec,
                                 posterior_fusion.load(tmp_path / "fedavg.h5").members[0]))


def _dense_ggn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n over ``model``'s parameters, float64, from autograd Jacobians."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def logits(ps, xi):
        return functional_call(model, ps, (xi[None],))[0]

    total = 0
    for xi in x:
        J = jacrev(logits)(params, xi)
        J = torch.cat([J[n].reshape(J[n].shape[0], -1) for n in params], dim=1)
        p = torch.softmax(logits(params, xi), -1)
        total = total + J.T @ (torch.diag(p) - torch.outer(p, p)) @ J
    return total


def test_the_subset_curvature_is_the_full_models_ggn_block():
    """diag: the head's diagonal equals the full model's GGN diagonal at the head's coordinates (dense float64
    GGN of the whole model); kron with one sample: the head's Kronecker block equals that dense block."""
    torch.manual_seed(1)
    full = SPEC.build().double()
    base = {n: p.detach().clone() for n, p in full.named_parameters()}
    tuned, _, _ = finetune_start(SPEC, parameters_to_vector(full.parameters()).float(), "last:2", 1)
    sub = ModelSpec("mlp", KW, finetune="last:2", base=base).build().double()
    vector_to_parameters(parameters_to_vector([base[n] for n, _ in sub.named_parameters()]), sub.parameters())
    x, y = torch.randn(30, 49, dtype=torch.float64), torch.randint(0, 10, (30,))
    G = _dense_ggn(full, x)
    names = list(base)
    sizes = [base[n].numel() for n in names]
    starts = dict(zip(names, torch.cumsum(torch.tensor([0] + sizes), 0).tolist()))
    idx = torch.cat([torch.arange(starts[n], starts[n] + base[n].numel()) for n, _ in sub.named_parameters()])
    diag, _ = capture("diag", sub, x, y, 64)
    torch.testing.assert_close(diag.diagonal().double(), torch.diagonal(G)[idx], rtol=1e-6, atol=1e-9)
    kron, _ = capture("kron", sub, x[:1], y[:1], 64)
    G1 = _dense_ggn(full, x[:1])
    w = torch.arange(starts["5.weight"], starts["5.weight"] + base["5.weight"].numel())
    head_block = next(b for b, off in zip(kron.blocks, kron.offsets) if off == 30 + 5)  # after 3.weight, 3.bias
    torch.testing.assert_close(head_block.to_dense().double(), G1[w][:, w], rtol=1e-6, atol=1e-9)
    assert tuned.finetune == "last:2" and len(tuned.frozen_shapes()) == 2


def test_lora_adapters_kfac_is_the_dense_ggn_and_fused_adapters_merge_into_the_weights(tmp_path, small_silo):
    """lora:R: the adapters' factors are Linear layers, so one sample's K-FAC block of an adapter factor is
    the dense float64 GGN block over it; a fused global rebuilt with merged weights W + B A predicts as the
    adapted model; the head is trained as it is."""
    torch.manual_seed(2)
    arch = SPEC.build()
    base = {n: p.detach().clone() for n, p in arch.named_parameters()}
    tuned, inits, start = finetune_start(SPEC, parameters_to_vector(arch.parameters()).detach(), "lora:2", 1, 3)
    model = tuned.build()
    names = [n for n, _ in model.named_parameters()]
    assert names == ["1.lora_A.weight", "1.lora_B.weight", "3.lora_A.weight", "3.lora_B.weight", "5.weight", "5.bias"]
    assert torch.equal(start, inits[0])
    x = torch.randn(4, 49)
    torch.testing.assert_close(model(x), arch(x), rtol=0, atol=0)  # B = 0: the base's function at the start
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    dmodel = tuned.build().double()
    vector_to_parameters(parameters_to_vector(model.parameters()).double(), dmodel.parameters())
    xd = torch.randn(1, 49, dtype=torch.float64)
    G = _dense_ggn(dmodel, xd)
    kron, _ = capture("kron", dmodel, xd, torch.tensor([3]), 64)
    sizes = [p.numel() for p in dmodel.parameters()]
    for k in range(4):  # each adapter factor's Kronecker block
        lo = sum(sizes[:k])
        block = next(b for b, off in zip(kron.blocks, kron.offsets) if off == lo)
        torch.testing.assert_close(block.to_dense().double(), G[lo: lo + sizes[k], lo: lo + sizes[k]], rtol=1e-6,
                                   atol=1e-9)
    merged = full_base(tuned, parameters_to_vector(model.parameters()).detach())
    plain = SPEC.build()
    vector_to_parameters(merged, plain.parameters())
    torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-5)
    A, B = model.get_submodule("1").lora_A.weight, model.get_submodule("1").lora_B.weight
    torch.testing.assert_close(dict(plain.named_parameters())["1.weight"], base["1.weight"] + B @ A)

    # the CLI flow: fit-local --finetune lora:2 runs, fuses and evaluates; artifact per component small
    path = tmp_path / "base.safetensors"
    save_file(base, str(path))
    _silos(tmp_path, small_silo)
    _run("init", "--model", "mlp", "--model-kwargs", '{"in_features": 49, "hidden_sizes": [6, 5]}', "-M", "1",
         "--base", path, "--out", tmp_path / "i.h5")
    for c in range(2):
        r = _run("fit-local", "--data", tmp_path / f"s{c}.h5", "--init", tmp_path / "i.h5", "--finetune", "lora:2",
                 "--structure", "kron", "--epochs", "1", "--train-seed", c, "--out", tmp_path / f"c{c}.h5")
        assert r.exit_code == 0, r.output
    r = _run("fuse", tmp_path / "c0.h5", tmp_path / "c1.h5", "--method", "fedbens", "--out", tmp_path / "g.h5")
    assert r.exit_code == 0, r.output
    r = _run("evaluate", tmp_path / "g.h5", "--data", tmp_path / "s0.h5", "--predictive", "glm", "--json")
    assert r.exit_code == 0, r.output
    # recapture --merge: the products ΔW with their own curvature, an artifact of the whole architecture
    for c in range(2):
        r = _run("recapture", "--artifact", tmp_path / f"c{c}.h5", "--data", tmp_path / f"s{c}.h5", "--merge",
                 "--out", tmp_path / f"m{c}.h5")
        assert r.exit_code == 0, r.output
    lora, merged = posterior_fusion.load(tmp_path / "c0.h5"), posterior_fusion.load(tmp_path / "m0.h5")
    assert merged.model_spec == SPEC and merged.metadata["merged_from"] == {"finetune": "lora:2"}
    torch.testing.assert_close(merged.components[0].map, full_base(lora.model_spec, lora.components[0].map))
    torch.testing.assert_close(merged.prior_mean, full_base(lora.model_spec, lora.prior_mean))
    plain = SPEC.build()
    vector_to_parameters(merged.components[0].map.clone(), plain.parameters())
    silo = posterior_fusion.data.silo.read_silo(tmp_path / "s0.h5")
    again, _ = capture("kron", plain, *silo.tensors(), 256)
    for a, b in zip(again.blocks, merged.components[0].curvature.blocks, strict=True):
        for ta, tb in zip(a.to_tensors().values(), b.to_tensors().values(), strict=True):
            torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-7)
    assert _run("fuse", tmp_path / "m0.h5", tmp_path / "m1.h5", "--method", "fedbens",
                "--out", tmp_path / "gm.h5").exit_code == 0
    r = _run("recapture", "--artifact", tmp_path / "m0.h5", "--data", tmp_path / "s0.h5", "--merge", "--out",
             tmp_path / "x.h5")
    assert r.exit_code == 2 and "nothing to merge" in r.stderr


def test_fine_tuning_refusals_are_one_line(tmp_path, small_silo):
    """--finetune without a base, a malformed setting, a tampered /frozen, and clients fine-tuning different parts."""
    path, _ = _base(tmp_path)
    _silos(tmp_path, small_silo)
    kw = '{"in_features": 49, "hidden_sizes": [6, 5]}'
    r = _run("fit-local", "--data", tmp_path / "s0.h5", "--model", "mlp", "--model-kwargs", kw, "--finetune", "head",
             "--out", tmp_path / "x.h5")
    assert r.exit_code == 2 and "init --base BASE" in r.stderr and r.stderr.count("\n") == 1, r.output
    _run("init", "--model", "mlp", "--model-kwargs", kw, "-M", "1", "--base", path, "--out", tmp_path / "i.h5")
    for bad in ("last:0", "lora:x", "head;rm", "last:99"):
        r = _run("fit-local", "--data", tmp_path / "s0.h5", "--init", tmp_path / "i.h5", "--finetune", bad,
                 "--epochs", "1", "--out", tmp_path / "x.h5")
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "finetune" in r.stderr, (bad, r.output)
    for c, ft in ((0, "head"), (1, "last:2")):
        assert _run("fit-local", "--data", tmp_path / f"s{c}.h5", "--init", tmp_path / "i.h5", "--finetune", ft,
                    "--structure", "diag", "--epochs", "1", "--out", tmp_path / f"c{c}.h5").exit_code == 0
    r = _run("fuse", tmp_path / "c0.h5", tmp_path / "c1.h5", "--method", "fedavg", "--out", tmp_path / "g.h5")
    assert r.exit_code == 2 and "differs" in r.stderr and r.stderr.count("\n") == 1, r.output
    with h5py.File(tmp_path / "c0.h5", "r+") as f:
        data = f["frozen"][()]
        del f["frozen"]
        f.create_dataset("frozen", data=data[:-1])
    with pytest.raises(ArtifactError, match="/frozen"):
        posterior_fusion.load(tmp_path / "c0.h5")
    with pytest.raises(ModelSpecError, match="does not hold"):
        ModelSpec("mlp", KW, finetune="head").build()


def test_a_client_that_forges_the_frozen_base_is_refused_by_fuse(tmp_path, small_silo):
    """The frozen base travels in every client artifact (``/frozen``): a client that shifts it (all of it, or
    one value) is refused by ``fuse`` in one line naming it; a negative frozen BatchNorm variance is refused by
    the reader."""
    path, _ = _base(tmp_path)
    _silos(tmp_path, small_silo)
    assert _run("init", "--model", "mlp", "--model-kwargs", '{"in_features": 49, "hidden_sizes": [6, 5]}', "-M", "1",
                "--base", path, "--out", tmp_path / "i.h5").exit_code == 0
    for c in range(2):
        r = _run("fit-local", "--data", tmp_path / f"s{c}.h5", "--init", tmp_path / "i.h5", "--finetune", "head",
                 "--structure", "diag", "--epochs", "1", "--train-seed", c, "--out", tmp_path / f"c{c}.h5")
        assert r.exit_code == 0, r.output
    assert _run("fuse", tmp_path / "c0.h5", tmp_path / "c1.h5", "--method", "fedavg",
                "--out", tmp_path / "ok.h5").exit_code == 0
    import shutil

    for name, forge in (("all", lambda v: v + 0.5), ("one", lambda v: v.__setitem__(3, v[3] + 1e-3) or v)):
        forged = tmp_path / f"forged_{name}.h5"
        shutil.copy(tmp_path / "c1.h5", forged)
        with h5py.File(forged, "r+") as f:
            f["frozen"][...] = forge(f["frozen"][()].copy())
        r = _run("fuse", tmp_path / "c0.h5", forged, "--method", "fedavg", "--out", tmp_path / f"g_{name}.h5")
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and forged.name in lines[0] and "frozen base" in lines[0], r.output
        assert not (tmp_path / f"g_{name}.h5").exists()


def test_a_negative_frozen_batchnorm_variance_is_refused_by_the_reader(tmp_path, small_silo):
    from conftest import fit_artifact

    kw = {"in_channels": 1, "width": 2, "norm": "batch"}
    fit_artifact(tmp_path / "bn.h5", SiloData(small_silo.x[:40], small_silo.y[:40], "fmnist", 10), "diag",
                 "resnet20", kw, mixtures=1)
    spec = posterior_fusion.load(tmp_path / "bn.h5").model_spec  # the honest one reads
    with h5py.File(tmp_path / "bn.h5", "r+") as f:
        values, offset = f["frozen"][()].copy(), 0
        for n, shape in spec.frozen_shapes():
            if n.endswith("running_var"):
                values[offset] = -1.0
                break
            offset += int(torch.tensor(shape).prod())
        f["frozen"][...] = values
    with pytest.raises(ArtifactError, match="negative"):
        posterior_fusion.load(tmp_path / "bn.h5")


@pytest.mark.parametrize("seed", ["seven", 10**19])
def test_an_init_file_whose_seed_is_out_of_range_is_one_line(tmp_path, small_silo, seed):
    """The init file is the server's: its recorded ``init_seed`` is checked with the CLI's range on the silo."""
    import json

    from posterior_fusion.artifact.writer import text_attr

    path, _ = _base(tmp_path)
    _silos(tmp_path, small_silo, 1)
    assert _run("init", "--model", "mlp", "--model-kwargs", '{"in_features": 49, "hidden_sizes": [6, 5]}', "-M", "1",
                "--base", path, "--out", tmp_path / "i.h5").exit_code == 0
    with h5py.File(tmp_path / "i.h5", "r+") as f:
        meta = json.loads(f.attrs["metadata"])
        meta["init_seed"] = seed
        f.attrs["metadata"] = text_attr(json.dumps(meta))
    r = _run("fit-local", "--data", tmp_path / "s0.h5", "--init", tmp_path / "i.h5", "--finetune", "head",
             "--structure", "diag", "--epochs", "1", "--out", tmp_path / "c.h5")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "init_seed" in r.stderr, r.output


def test_a_lora_rank_beyond_the_layers_is_refused_before_any_work(tmp_path, small_silo):
    """``--finetune lora:9999`` on layers of at most 49 inputs: one line naming the layer, exit 2, before training
    — the subprocess's peak memory stays that of the interpreter and torch, far under the budget."""
    import sys

    path, _ = _base(tmp_path)
    _silos(tmp_path, small_silo, 1)
    assert _run("init", "--model", "mlp", "--model-kwargs", '{"in_features": 49, "hidden_sizes": [6, 5]}', "-M", "1",
                "--base", path, "--out", tmp_path / "i.h5").exit_code == 0
    from conftest import run_measured

    r, peak_kib = run_measured([Path(sys.executable).parent / "pfuse", "fit-local", "--data", tmp_path / "s0.h5",
                                "--init", tmp_path / "i.h5", "--finetune", "lora:9999", "--max-memory", "256M",
                                "--out", tmp_path / "c.h5"])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "rank 9999 exceeds layer" in r.stderr, r.stderr
    assert peak_kib < 1.5 * 2**20, peak_kib  # KiB: under 1.5 GiB (torch itself is about 0.4)
    assert not (tmp_path / "c.h5").exists()


@pytest.mark.parametrize("finetune", ["head", "last:2", "lora:2"])
def test_fused_networks_export_like_any_pytorch_model(tmp_path, small_silo, finetune):
    """``models()[k].state_dict()`` of a global fine-tuned from a base is complete (frozen weights back, LoRA
    merged): it loads with ``strict=True`` into a fresh module of the architecture and predicts as ``predict``;
    ``models_for_raw_inputs()`` takes raw data; ``pfuse export`` read with plain safetensors reproduces
    ``predict()`` without this package's model code."""
    import json as json_module

    from safetensors.torch import load_file

    path, _ = _base(tmp_path)
    _silos(tmp_path, small_silo)
    assert _run("init", "--model", "mlp", "--model-kwargs", '{"in_features": 49, "hidden_sizes": [6, 5]}', "-M", "1",
                "--base", path, "--out", tmp_path / "i.h5").exit_code == 0
    for c in range(2):
        assert _run("fit-local", "--data", tmp_path / f"s{c}.h5", "--init", tmp_path / "i.h5", "--finetune", finetune,
                    "--structure", "diag", "--epochs", "2", "--train-seed", c, "--out", tmp_path / f"c{c}.h5").exit_code == 0
    assert _run("fuse", tmp_path / "c0.h5", tmp_path / "c1.h5", "--method", "fedavg",
                "--out", tmp_path / "g.h5").exit_code == 0
    g = posterior_fusion.load(tmp_path / "g.h5")
    x_raw = small_silo.x[160:200, ::4, ::4]
    want = g.predict(x_raw)
    model = g.models()[0]
    state = model.state_dict()
    fresh = SPEC.build() if finetune == "all" else ModelSpec("mlp", KW).architecture()
    fresh.load_state_dict(state, strict=True)
    assert set(state) == {n for n, _ in nn.Sequential(*SPEC.build().children()).named_parameters()}
    inputs = posterior_fusion.models.members.model_inputs(g.model_spec, g.metadata.get("input_transform"), x_raw, False, "x")
    with torch.no_grad():
        torch.testing.assert_close(torch.softmax(fresh.eval()(inputs), -1), want, rtol=1e-5, atol=1e-6)
        raw_model = g.models_for_raw_inputs()[0]
        torch.testing.assert_close(torch.softmax(raw_model(torch.as_tensor(x_raw)), -1), want, rtol=1e-5, atol=1e-6)
    r = _run("export", tmp_path / "g.h5", "--out", tmp_path / "net.safetensors")
    assert r.exit_code == 0, r.output
    described = json_module.loads((tmp_path / "net.safetensors.json").read_text())
    assert described["model_spec"] == {"name": "mlp", "kwargs": KW}
    loaded = load_file(str(tmp_path / "net.safetensors"))
    # a user's own plain PyTorch model of the same architecture: Flatten, Linear 49→6, ReLU, Linear 6→5, ReLU, Linear 5→10
    own = nn.Sequential(nn.Flatten(), nn.Linear(49, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 10))
    own.load_state_dict(loaded, strict=True)
    t = described["input_transform"]
    x = (torch.as_tensor(x_raw).float() * t["scale"] - t["mean"][0]) / t["std"][0]
    with torch.no_grad():
        torch.testing.assert_close(torch.softmax(own(x), -1), want, rtol=1e-5, atol=1e-6)
    r = _run("export", tmp_path / "g.h5", "--member", "3", "--out", tmp_path / "x.safetensors")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "member" in r.stderr
