"""The extension points: per-method settings records, the block-type table, no import cycles."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import fit_split, random_psd

import posterior_fusion
from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.artifact.blocks import ENCODINGS, BlockEncoding
from posterior_fusion.cli.main import pfuse
from posterior_fusion.curvature import BLOCK_TYPES, BlockDiag, CompressedKron, Dense, Diag, Kron, Precision
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion import METHODS, FusionMethod, FusionResult, fuse
from posterior_fusion.fusion.block_stacks import STACKERS
from posterior_fusion.fusion.gaussian_stack import StackedGaussians
from posterior_fusion.fusion.methods.fedbens import FedBEnsSettings, GlobalLogPosterior
from posterior_fusion.fusion.settings_parsing import MethodSettings, setting
from posterior_fusion.posterior import Component

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_clients(tmp_path_factory, small_silo):
    return fit_split(tmp_path_factory.mktemp("design"), small_silo, 2, 100, "diag", mixtures=2)


def test_settings_records_parse_validate_and_describe():
    s = FedBEnsSettings.from_mapping({"steps": "12", "adam_lr": "0.5", "modes": "none"}, "fedbens")
    assert (s.steps, s.adam_lr, s.modes, s.clip) == (12, 0.5, None, 1.0)
    with pytest.raises(ConfigError, match="has no setting 'stepz'"):
        FedBEnsSettings.from_mapping({"stepz": "1"}, "fedbens")
    with pytest.raises(ConfigError, match="'steps' must be int"):
        FedBEnsSettings.from_mapping({"steps": "1.5"}, "fedbens")
    with pytest.raises(ConfigError, match="adam_lr"):
        FedBEnsSettings.from_mapping({"adam_lr": "-1"}, "fedbens")
    with pytest.raises(ConfigError, match="must be float"):
        FedBEnsSettings.from_mapping({"adam_lr": "inf"}, "fedbens")
    names = [r["name"] for r in FedBEnsSettings.describe()]
    assert names == ["steps", "adam_lr", "clip", "val_every", "modes", "laplace", "laplace_prior", "mode_weights",
                     "allow_different_inits", "spectral_cutoff", "starts", "solver", "damping", "trust_radius",
                     "prior_centre", "server_prior"]
    assert all(r["help"] for r in FedBEnsSettings.describe())
    with pytest.raises(ConfigError, match="solver must be one of"):
        FedBEnsSettings.from_mapping({"solver": "lbfgs"}, "fedbens")


def test_cli_set_and_help_method(tmp_path, two_clients):
    out = tmp_path / "g.h5"
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, two_clients), "--method", "fedbens", "--set", "steps=3",
                                   "--set", "modes=1", "--set", "solver=adam", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    g = posterior_fusion.load(out)
    assert g.metadata["settings"]["steps"] == 3 and len(g.members) == 1
    assert [h["step"] for h in g.metadata["history"][0]][-1] == 3
    assert json.loads(r.stdout)["resolved"] == {"solver": "adam", "prior_centre": "prior", "server_prior": "clients"}
    # the names a method renamed: one line with the new name, exit 2
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, two_clients), "--method", "fedfisher", "--set", "damping=0.1",
                                   "--out", str(tmp_path / "f.h5")])
    assert r.exit_code == 2 and "'damping' is now 'prior_scale'" in r.stderr and r.stderr.count("\n") == 1
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, two_clients), "--method", "fedavg", "--set", "steps=3",
                                   "--out", str(tmp_path / "h.h5")])
    assert r.exit_code == 2 and "method 'fedavg' has no setting 'steps'" in r.stderr and r.stderr.count("\n") == 1
    r = CliRunner().invoke(pfuse, ["fuse", "--help-method", "regmean"])
    assert r.exit_code == 0 and "alpha" in r.stdout and "[default: reference]" in r.stdout
    r = CliRunner().invoke(pfuse, ["fuse", "--method", "fedbens", "--set", "oops", "--out", "x.h5", str(two_clients[0])])
    assert r.exit_code == 2 and "key=value" in r.stderr


def test_deprecated_spellings_warn_and_still_work(tmp_path, two_clients, small_silo):
    from posterior_fusion.data.silo import write_silo

    write_silo(tmp_path / "s.h5", SiloData(small_silo.x[:60], small_silo.y[:60], "fmnist", 10))
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "mlp", "--mixtures", "1",
                                   "--hessian", "diag", "--seed", "4", "--epochs", "1", "--private-model", "mlp",
                                   "--private-model-kwargs", '{"hidden": 4}', "--private-epochs", "1",
                                   "--private-weight", "0.3", "--out", str(tmp_path / "a.h5")])
    assert r.exit_code == 0, r.stderr
    for old, new in (("--mixtures", "--components"), ("--hessian", "--structure"), ("--seed", "--train-seed"),
                     ("--private-model", "--local-model"), ("--private-model-kwargs", "--local-model-kwargs"),
                     ("--private-epochs", "--local-model-epochs"), ("--private-weight", "--local-model-weight")):
        assert f"warning: {old} is deprecated" in r.stderr and new in r.stderr
    art = posterior_fusion.load(tmp_path / "a.h5")
    assert art.num_components == 1 and art.structure == "diag" and art.metadata["train_seed"] == 4
    assert art.metadata["hbfl_local_model"] == {"weight": 0.3, "epochs": 1}
    from posterior_fusion.local.fit_config import fit_config_from

    with contextlib.redirect_stderr(io.StringIO()) as err:  # the TOML's [fit] keys and Flower's run config
        old_keys = fit_config_from({"private_model": "mlp", "private_weight": 0.3})
    assert old_keys == fit_config_from({"local_model": "mlp", "local_model_weight": 0.3})
    assert "key 'private_weight' is deprecated" in err.getvalue() and "'local_model_weight'" in err.getvalue()
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, two_clients), "--method", "fedfisher", "--steps", "2",
                                   "--lr", "0.01", "--out", str(tmp_path / "g.h5")])
    assert r.exit_code == 0 and "--steps is deprecated; use --set steps=2" in r.stderr
    assert posterior_fusion.load(tmp_path / "g.h5").metadata["settings"] == {"steps": 2, "adam_lr": 0.01, "clip": 1.0,
                                                                              "val_every": 30, "solver": "adam",
                                                                              "prior_scale": 1e-8,
                                                                              "tune_prior_scale": False}


@dataclass(frozen=True)
class ShrinkSettings(MethodSettings):
    factor: float = setting(0.5, "Multiply the FedAvg weights by this.")


def shrink(inputs, settings: ShrinkSettings) -> FusionResult:
    return FusionResult([settings.factor * (inputs.n_weights()[:, None] * inputs.mode_maps()).sum(0)])


def test_a_new_method_needs_only_its_function_settings_and_a_registry_entry(monkeypatch, two_clients):
    monkeypatch.setitem(METHODS, "shrink", FusionMethod("shrink", shrink, ShrinkSettings, "test method"))
    _, res, meta = fuse(two_clients, "shrink", settings={"factor": "0.25"})
    _, avg, _ = fuse(two_clients, "fedavg")
    torch.testing.assert_close(res.members[0], 0.25 * avg.members[0])
    assert meta["settings"] == {"factor": 0.25} and meta["method"] == "shrink"


class Iso(Precision):
    """A toy block type for the table test: ``G = g·I`` stored as one scalar."""

    kind = "iso"

    def __init__(self, g: torch.Tensor, size: int, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale, shift)
        self.g, self.size = g, size

    @property
    def dim(self) -> int:
        return self.size

    def with_scale_shift(self, scale, shift):
        return Iso(self.g, self.size, scale, shift)

    def _lam(self):
        return self.scale * self.g[0] + self.shift

    def quadratic_form(self, v):
        return self._lam() * v.square().sum(-1)

    def matvec(self, v):
        return self._lam() * v

    def logdet(self):
        return self.size * torch.log(self._lam())

    def spectrum(self):
        return (self.scale * self.g.double()).expand(self.size), None

    def sample(self, n, generator=None):
        return torch.randn(n, self.size, generator=generator, dtype=self.g.dtype) / self._lam().sqrt()

    def to_dense(self):
        return self._lam() * torch.eye(self.size, dtype=self.g.dtype)

    def diagonal(self):
        return self._lam().expand(self.size)

    @property
    def nbytes(self):
        return self.g.element_size()

    def to_tensors(self):
        return {"iso": self.g}


# Iso on disk: one scalar dataset (the artifact's table entry)
ISO_ENCODING = BlockEncoding(("iso",), lambda size, header: {"iso": (1,)},
                             lambda tensors, header: Iso(tensors["iso"], int(header["size"])))



def stack_iso(blocks, offset, mu, scales, shifts, dtype, spectral_cutoff=0.0, kernel=None):
    """Iso's batched evaluation: fusion's table entry (as a diagonal)."""
    return STACKERS["diag"]([Diag(b.g.expand(b.size).to(dtype)) for b in blocks], offset, mu, scales, shifts, dtype)


def test_a_new_block_type_needs_only_its_class_and_its_table_entries(monkeypatch, tmp_path):
    """Writer and reader find an unknown-to-them block type through ENCODINGS, the stack through STACKERS."""
    from conftest import TINY, TINY_LAYOUT

    monkeypatch.setitem(BLOCK_TYPES, "iso", Iso)
    monkeypatch.setitem(ENCODINGS, "iso", ISO_ENCODING)
    monkeypatch.setitem(STACKERS, "iso", stack_iso)
    gen = torch.Generator().manual_seed(0)
    d = TINY_LAYOUT.dim
    comps = [Component(m, torch.randn(d, generator=gen, dtype=torch.float64),
                       BlockDiag([Iso(torch.tensor([0.5 + m], dtype=torch.float64), 15), Dense(random_psd(d - 15, gen))]),
                       {}, 0.5, 2.0) for m in range(2)]
    meta = {"n_data": 10, "class_counts": [4, 6], "temperature": 0.5, "prior_precision": 2.0, "structure": "iso+full"}
    write_client_artifact(tmp_path / "iso.h5", TINY, TINY_LAYOUT, meta, comps)
    art = posterior_fusion.load(tmp_path / "iso.h5")
    assert art.components[1].curvature.blocks[0].kind == "iso"
    W = torch.randn(3, d, generator=gen, dtype=torch.float64)
    for c_read, c_made in zip(art.components, comps):
        dense = c_made.precision().to_dense()
        v = W - c_made.map
        torch.testing.assert_close(c_read.precision().quadratic_form(v), torch.einsum("ki,ij,kj->k", v, dense, v))
    stack = StackedGaussians(list(art.components), 2.0, 2.0, torch.float64)
    ref = torch.stack([c.precision(0.5, 2.0).quadratic_form(W - c.map) for c in comps], -1)
    torch.testing.assert_close(stack.quadratic_forms(W), ref)
    torch.testing.assert_close(stack.logdets, torch.stack([torch.logdet(c.precision(0.5, 2.0).to_dense()) for c in comps]))
    obj = GlobalLogPosterior([art], [0.5], [2.0], 2.0, torch.float64)
    assert torch.isfinite(obj(W)).all()


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_every_table_entry_round_trips_and_matches_dense(kind):
    gen = torch.Generator().manual_seed(1)
    make = {"diag": lambda: Diag(torch.rand(12, generator=gen, dtype=torch.float64)),
            "dense": lambda: Dense(random_psd(12, gen)),
            "kron": lambda: Kron(random_psd(3, gen), random_psd(4, gen)),
            "kron_lowrank": lambda: CompressedKron.from_kron(Kron(random_psd(3, gen), random_psd(4, gen)), 0.3)}
    blocks = [make[kind]() for _ in range(3)]
    cls, enc = BLOCK_TYPES[kind], ENCODINGS[kind]
    assert isinstance(blocks[0], cls)
    again = enc.decode(blocks[0].to_tensors(), {"kind": kind, "size": 12, **enc.header(blocks[0])})
    torch.testing.assert_close(again.to_dense(), blocks[0].to_dense())
    assert enc.shapes(12, enc.header(blocks[0])) == {k: tuple(t.shape) for k, t in blocks[0].to_tensors().items()}
    mu = torch.randn(3, 12, generator=gen, dtype=torch.float64)
    scales, shifts = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64), torch.tensor([0.1, 1.0, 3.0], dtype=torch.float64)
    st = STACKERS[kind](blocks, 0, mu, scales, shifts, torch.float64)
    W = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    dense = [b.precision(1 / s.item(), t.item()).to_dense() for b, s, t in zip(blocks, scales, shifts)]
    ref = torch.stack([torch.einsum("ki,ij,kj->k", W - m, D, W - m) for m, D in zip(mu, dense)], -1)
    torch.testing.assert_close(st.quadratic_forms(W), ref)
    torch.testing.assert_close(st.logdets, torch.stack([torch.logdet(D) for D in dense]))
    # solve is the inverse of matvec (dense float64 reference)
    p = blocks[0].precision(0.5, 0.3)
    torch.testing.assert_close(p.solve(W), torch.linalg.solve(p.to_dense(), W.T).T)
    u = p.whiten(W)  # u uᵀ = W Λ⁻¹ Wᵀ
    torch.testing.assert_close(u @ u.T, W @ torch.linalg.solve(p.to_dense(), W.T))
    # Tikhonov damping at per-sample scale: a Kronecker block's factors each get d (B sums over n
    # samples: n·d), any other block n·d on its diagonal; the kind (and compactness) is kept
    n, dmp = 7.0, 0.3
    damped = blocks[0].damped(n, dmp)
    assert type(damped) is cls
    if kind in ("kron", "kron_lowrank"):
        B, A = blocks[0].B.double(), blocks[0].A.double()
        ref_damped = torch.kron(B + n * dmp * torch.eye(3, dtype=B.dtype), A + dmp * torch.eye(4, dtype=A.dtype))
    else:
        ref_damped = blocks[0].to_dense() + n * dmp * torch.eye(12, dtype=torch.float64)
    torch.testing.assert_close(damped.to_dense().double(), ref_damped)
    if kind in ("kron", "kron_lowrank"):
        with pytest.raises(posterior_fusion.errors.MethodNotApplicableError):
            cls.sum_of(blocks)
    else:
        torch.testing.assert_close(cls.sum_of(blocks, 0.7).to_dense(),
                                   sum(b.to_dense() for b in blocks) + 0.7 * torch.eye(12, dtype=torch.float64))


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("posterior_fusion"):
            subs = [f"{node.module}.{a.name}" for a in node.names]
            real = [m for m in subs if _module_path(m) is not None]
            out.update(real)
            if len(real) < len(subs):
                out.add(node.module)
    return out


def _module_path(name: str) -> Path | None:
    rel = name.replace("posterior_fusion.cli", "cli", 1) if name.startswith("posterior_fusion.cli") else name
    parts = rel.split(".")
    for cand in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if cand.exists():
            return cand
    return None


def test_no_import_cycles_and_only_local_imports_laplace():
    files = list((ROOT / "posterior_fusion").rglob("*.py")) + list((ROOT / "cli").rglob("*.py"))
    names = {}
    for f in files:
        rel = f.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[0] == "cli":
            parts = ["posterior_fusion", "cli"] + parts[1:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = f
    graph = {n: {d for d in _imports(f) if d in names and d != n} for n, f in names.items()}
    state: dict[str, int] = {}

    def visit(n, trail):
        state[n] = 1
        for d in graph[n]:
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(trail[trail.index(d):] + [d]) if d in trail else d)
            if d not in state:
                visit(d, trail + [d])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [n])
    for n, f in names.items():
        for node in ast.walk(ast.parse(f.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m == "laplace" or m.startswith("laplace.") for m in mods):
                assert n.startswith("posterior_fusion.local"), f"{n} imports laplace-torch"


def test_plain_adam_matches_torch_adam():
    from posterior_fusion.fusion.optimise import Adam

    g = torch.Generator().manual_seed(0)
    target = torch.randn(3, 7, generator=g, dtype=torch.float64)
    a = torch.zeros(3, 7, dtype=torch.float64, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ours, ref = Adam(a, lr=0.05), torch.optim.Adam([b], lr=0.05)
    for _ in range(50):
        for w, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            ((w - target) ** 4).sum().backward()
            opt.step()
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_plain_momentum_sgd_matches_torch_sgd():
    from posterior_fusion.fusion.optimise import MomentumSGD

    g = torch.Generator().manual_seed(1)
    target = torch.randn(4, 5, generator=g, dtype=torch.float64)
    a = torch.zeros(4, 5, dtype=torch.float64, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    ours, ref = MomentumSGD([a], lr=0.01, momentum=0.9), torch.optim.SGD([b], lr=0.01, momentum=0.9)
    for step in range(40):
        lr = 0.01 * (1 - step / 80)  # the step size may change between steps (SWA's cycles)
        ours.lr = lr
        for group in ref.param_groups:
            group["lr"] = lr
        for w, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            ((w - target) ** 4).sum().backward()
            opt.step()
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# Strings equal to a method's name that mean something else (a partition scheme named after the
# FedBEns authors' split; the HDF5 group of SWAG moments), allowed where that other idea lives.
OTHER_IDEAS = {"fedbens": {"posterior_fusion/data/partition.py", "posterior_fusion/data/prepare.py",
                           "cli/data_commands.py"},
               "swag": {"posterior_fusion/artifact/writer.py", "posterior_fusion/artifact/reader.py",
                        "posterior_fusion/artifact/schema.py", "posterior_fusion/artifact/records.py"}}


def test_no_method_name_appears_outside_its_module_and_the_registry():
    """Methods own their quirks: no other module branches on (or spells) a method's name."""
    names = set(METHODS)
    found = []
    for path in sorted([*(ROOT / "posterior_fusion").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("posterior_fusion/fusion/methods/") or rel == "posterior_fusion/fusion/registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                if rel not in OTHER_IDEAS.get(node.value, set()):
                    found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, found


def test_every_package_of_the_tree_is_in_the_wheel():
    """A folder added to the library must be listed in pyproject's packages (or the wheel breaks)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "posterior_fusion").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


def test_library_errors_name_settings_and_the_cli_shows_flags(tmp_path):
    """No error raised by the library spells a command-line flag: it names the setting in
    backticks, and the CLI's one mapping shows the flag."""
    import re

    from posterior_fusion.cli.common import as_flags

    flag = re.compile(r"(?<![\w`])--[a-z]")
    found = []
    for path in sorted((ROOT / "posterior_fusion").rglob("*.py")):
        src = path.read_text()
        lines = src.split("\n")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if flag.search(text):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
    assert as_flags("lower `min_size` or pass `data_dir`; `x` stays") == "lower --min-size or pass --data-dir; --x stays"
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--momentum", "1.5",
                                   "--out", str(tmp_path / "c.h5")])
    assert r.exit_code == 2 and "--momentum must be" in r.stderr and "`" not in r.stderr
    from posterior_fusion.data.partition import dirichlet_partition

    with pytest.raises(ConfigError, match="`clients` must be"):  # the library's own spelling
        dirichlet_partition(torch.zeros(10, dtype=torch.long).numpy(), 0, 0.5, 0)


@pytest.mark.parametrize("structure", ["diag", "kron", "diag+full"])
def test_one_mixture_type_against_torch_distributions(structure):
    """Client posteriors evaluate, draw and predict through the one ``GaussianMixture``; its density
    equals a float64 mixture of dense ``MultivariateNormal`` s with unequal weights."""
    from conftest import random_clients

    from posterior_fusion.mixture import GaussianMixture

    c = random_clients(structure, 1, 3, seed=11)[0]
    weights = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    mix = GaussianMixture.of([k.map for k in c.components], [k.precision() for k in c.components], weights)
    w = torch.randn(5, c.layout.dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    dense = [torch.distributions.MultivariateNormal(k.map.double(), precision_matrix=k.precision().to_dense().double())
             for k in c.components]
    want = torch.logsumexp(torch.stack([d.log_prob(w) for d in dense], -1) + weights.log(), -1)
    torch.testing.assert_close(mix.log_prob(w), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c.log_prob(w), torch.logsumexp(torch.stack([d.log_prob(w) for d in dense], -1)
                                                              - torch.log(torch.tensor(3.0)), -1), rtol=1e-6, atol=1e-6)
    draws = mix.sample(4000, torch.Generator().manual_seed(0))
    assert draws.shape == (4000, c.layout.dim)
    torch.testing.assert_close(draws.mean(0), sum(p * k.map.double() for p, k in zip(weights, c.components)),
                               rtol=0, atol=0.15)


def test_curvature_is_algebra_and_imports_nothing_above_it():
    """``curvature/`` is the maths of one precision: it imports nothing from fusion, kernels,
    artifact (nor any other layer above it); batched evaluation lives in ``fusion/block_stacks.py``."""
    above = ("posterior_fusion.fusion", "posterior_fusion.kernels", "posterior_fusion.artifact",
             "posterior_fusion.local", "posterior_fusion.data", "posterior_fusion.models")
    found = []
    for path in sorted((ROOT / "posterior_fusion" / "curvature").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith(above)]
    assert not found, found
    from posterior_fusion.artifact.blocks import ENCODINGS as encodings
    from posterior_fusion.curvature import BLOCK_TYPES as kinds
    from posterior_fusion.fusion.block_stacks import STACKERS as stackers

    assert set(kinds) == set(stackers) == set(encodings)  # every block kind is stored and evaluated in batches


def test_a_fit_setting_declared_once_appears_in_the_cli_flower_and_toml(monkeypatch, tmp_path):
    """Add a field to TrainConfig at run time: fit-local's --help, the Flower run config and the
    experiment TOML's [fit] table all accept it, and it reaches the FitConfig they build."""
    import importlib
    from dataclasses import make_dataclass

    from posterior_fusion.cli import local_commands
    from posterior_fusion.experiment.grid_config import ExperimentConfig
    from posterior_fusion.flower.federated_settings import FederatedSettings
    from posterior_fusion.local import fit_config as config
    from posterior_fusion.settings import setting

    extended = make_dataclass("TrainConfig", [("label_smoothing", float, setting(0.0, "Label smoothing (a test)."))],
                              bases=(config.TrainConfig,), frozen=True)
    monkeypatch.setattr(config, "TrainConfig", extended)
    try:
        importlib.reload(local_commands)  # the command's options are derived when its module loads
        r = CliRunner().invoke(pfuse, ["fit-local", "--help"])
        assert "--label-smoothing" in r.stdout and "Label smoothing (a test)." in r.stdout
        flower = FederatedSettings.from_run_config({"label-smoothing": 0.25, "epochs": 2})
        assert flower.fit_config().train.label_smoothing == 0.25 and flower.fit_config().train.epochs == 2
        assert FederatedSettings.from_json(flower.to_json()) == flower
        (tmp_path / "g.toml").write_text("[fit]\nlabel_smoothing = 0.5\n")
        grid = ExperimentConfig.from_toml(tmp_path / "g.toml")
        from posterior_fusion.experiment.grid import client_fit_config

        assert client_fit_config(grid, "kron", 3).train.label_smoothing == 0.5
        (tmp_path / "bad.toml").write_text("[fit]\nlabel_smootihng = 0.5\n")
        with pytest.raises(ConfigError, match="no fit setting 'label_smootihng'"):
            ExperimentConfig.from_toml(tmp_path / "bad.toml")
    finally:
        monkeypatch.undo()
        importlib.reload(local_commands)
    assert "--label-smoothing" not in CliRunner().invoke(pfuse, ["fit-local", "--help"]).stdout


# The package-level layers, bottom to top (docs/architecture.md): a package may import its own layer
# and the layers below it, never one above. The small shared modules sit at the bottom.
LAYERS = [
    {"errors", "files", "ranges", "budget", "progress", "layout", "runtime", "compat", "hdf5_safety", "settings", "choices",
     "environment", "predictive_settings", "__init__"},
    {"curvature", "kernels", "data", "pooling"},
    {"models"},
    {"predictive"},
    {"artifact", "posterior", "mixture", "summary"},
    {"local", "fusion", "metrics"},
    {"experiment", "flower", "demo"},
    {"cli"},
]


def _package_of(module: str) -> str:
    """``posterior_fusion.fusion.methods.fedbens`` -> ``fusion``; ``posterior_fusion`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_packages_import_only_their_layer_and_the_layers_below():
    rank = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    found, edges = [], set()
    for path in sorted([*(ROOT / "posterior_fusion").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        rel = path.relative_to(ROOT).with_suffix("").parts
        src = "cli" if rel[0] == "cli" else (rel[1] if len(rel) > 1 else "__init__")
        assert src in rank, f"{path.relative_to(ROOT)}: package {src!r} has no layer in LAYERS"
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("posterior_fusion")):
                continue
            targets = ([f"posterior_fusion.{a.name}" for a in node.names] if node.module == "posterior_fusion"
                       else [node.module])
            for target in targets:
                dst = "cli" if target.startswith("posterior_fusion.cli") else _package_of(target)
                if dst == "__version__":
                    dst = "__init__"
                if dst == src:
                    continue
                edges.add((src, dst))
                if rank[dst] > rank[src]:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {src} (layer {rank[src]}) imports "
                                 f"{target} (layer {rank[dst]})")
    assert not found, found
    # within a layer, no two packages import each other (directly or through others of that layer)
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if rank[a] == rank[b]:
            graph.setdefault(a, set()).add(b)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in graph.get(a, ()))

    assert not [(a, b) for a in graph for b in graph[a] if reaches(b, a, {b})]
    # loading an artifact does not import the silo's capture code
    import subprocess
    import sys

    code = ("import sys, posterior_fusion; posterior_fusion.load; "
            "import posterior_fusion.artifact, posterior_fusion.predictive; "
            "print(sorted(m for m in sys.modules if m.startswith(('posterior_fusion.local', 'posterior_fusion.fusion'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_compressed_kron_answers_every_operation_from_its_compact_form(monkeypatch):
    """``CompressedKron`` never rebuilds a ``D × D`` factor behind a caller's back: with ``rebuild`` made to
    fail, every operation still answers, and each equals the dense float64 reference."""
    from posterior_fusion.curvature import compressed

    gen = torch.Generator().manual_seed(3)
    block = compressed.CompressedKron.from_kron(Kron(random_psd(5, gen), random_psd(7, gen)), 0.3).precision(0.5, 0.2)
    dense = block.to_dense()
    W = torch.randn(4, block.dim, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(compressed, "rebuild", lambda *a, **k: pytest.fail("a dense factor was rebuilt"))
    torch.testing.assert_close(block.matvec(W), W @ dense)
    torch.testing.assert_close(block.solve(W), torch.linalg.solve(dense, W.T).T)
    u = block.whiten(W)
    torch.testing.assert_close(u @ u.T, W @ torch.linalg.solve(dense, W.T))
    torch.testing.assert_close(block.diagonal(), torch.diagonal(dense))
    torch.testing.assert_close(block.quadratic_form(W), torch.einsum("ki,ij,kj->k", W, dense, W))
    torch.testing.assert_close(block.logdet(), torch.logdet(dense))
    draws = block.sample(20000, torch.Generator().manual_seed(0))
    torch.testing.assert_close(draws.T @ draws / 20000, torch.linalg.inv(dense), rtol=0, atol=0.05)


HISTORY = re.compile(r"\b(?:issues?|sessions?)[\s-]*#?\d+|\(issue:|measured in session|\bthe issue\b|\bas asked\b",
                     re.I)


def test_the_product_speaks_of_the_product_not_of_its_history():
    """No issue or session numbers in the library, the CLI, the README, the docs, the studies, the benchmarks,
    the examples, the scripts or the tests (a figure a docstring needs points to a benchmark or a test by name; how
    a result was reached lives in git)."""
    kinds = (".md", ".toml", ".txt", ".py", ".sh")
    texts = [ROOT / "README.md", *(p for folder in ("posterior_fusion", "cli", "docs", "experiments", "benchmarks",
                                                    "examples", "scripts", "tests")
                                   for p in (ROOT / folder).rglob("*") if p.suffix in kinds and p.is_file())]
    found = [f"{p.relative_to(ROOT)}:{i} {m.group(0)!r}" for p in texts
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if not line.startswith("HISTORY = ") for m in [HISTORY.search(line)] if m]
    assert not found, found


def _scripts() -> list[Path]:
    return sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "experiments").rglob("*.py")])


def test_benchmarks_and_studies_name_no_machine_folder():
    """Every command and path in benchmarks/ and experiments/ runs from a fresh clone: no absolute path."""
    absolute = re.compile(r"(?<![\w.$~])/(?:tmp|work|home|root|Users|mnt|opt|var)/")
    files = [*_scripts(), *(ROOT / "benchmarks").glob("*.sh"), *(ROOT / "experiments").rglob("*.sh"),
             *(ROOT / "experiments").rglob("*.toml"), *(ROOT / "experiments").rglob("*.md")]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
             if absolute.search(line)]
    assert not found, found


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_benchmark_and_study_script_imports_and_answers_help(script, monkeypatch, capsys):
    """Each script imports from a fresh clone (its helpers are importable modules, siblings beside it)
    and ``--help`` prints its usage and exits 0 without doing any work."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


def test_choosing_page_is_what_its_command_generates():
    """``docs/choosing.md`` is generated from the studies' committed results by ``experiments/choosing.py``;
    the committed page equals what the command produces now, and its recommended row is the default
    ``pfuse fuse`` runs."""
    import runpy

    from posterior_fusion.fusion.registry import DEFAULT_METHOD, DEFAULT_SETTINGS

    module = runpy.run_path(str(ROOT / "experiments" / "choosing.py"))
    assert (ROOT / "docs" / "choosing.md").read_text() == module["render"]()
    first = module["rows"]()[0]
    assert "default" in first.situation and f"--method {DEFAULT_METHOD}" in first.command
    assert all(f"{k}={v}" in first.command for k, v in DEFAULT_SETTINGS.items())


def test_a_misspelt_boolean_is_one_clear_error_everywhere(tmp_path, two_clients):
    """``"ture"`` for a boolean setting: one ConfigError naming the setting in a TOML ``[fit]`` table, a
    Flower run config and ``fuse --set`` (never silently False)."""
    from posterior_fusion.experiment.grid_config import ExperimentConfig
    from posterior_fusion.flower.federated_settings import FederatedSettings

    (tmp_path / "g.toml").write_text("[fit]\nswag = \"ture\"\n")
    with pytest.raises(ConfigError, match=r"swag.*must be bool.*ture"):
        ExperimentConfig.from_toml(tmp_path / "g.toml")
    with pytest.raises(ConfigError, match=r"swag.*must be bool.*ture"):
        FederatedSettings.from_run_config({"swag": "ture"}).fit_config()
    r = CliRunner().invoke(pfuse, ["fuse", *map(str, two_clients), "--method", "fedbens", "--set", "laplace=ture",
                                   "--out", str(tmp_path / "g.h5")])
    assert r.exit_code == 2 and "'laplace' must be bool" in r.stderr and r.stderr.count("\n") == 1
    for word, value in (("yes", True), ("0", False), ("False", False)):
        assert FederatedSettings.from_run_config({"swag": word}).fit_config().train.swag is value


def test_the_data_commands_and_reading_a_data_file_do_not_import_torch(tmp_path):
    """`pfuse import-data` / `partition` build their options, and a data file is read and described, without
    importing torch (their --help starts in a fraction of a second; docs/benchmarks.md, "Start-up")."""
    import subprocess
    import sys

    import numpy as np

    from posterior_fusion.data.silo import SiloData, write_silo

    write_silo(tmp_path / "d.h5", SiloData(np.zeros((4, 3, 3), np.uint8), np.arange(4) % 2, "toy", 2))
    code = ("import sys; import cli.data_commands; from posterior_fusion.data.silo import read_silo, describe_data; "
            f"describe_data({str(tmp_path / 'd.h5')!r}); read_silo({str(tmp_path / 'd.h5')!r}).class_counts(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_every_command_s_help_imports_no_torch():
    """`pfuse COMMAND --help` for every command builds its options from torch-free declarations (the choices, the
    settings records, the registry's names): torch is not imported, so help starts in a fraction of a second
    (docs/benchmarks.md, "Start-up"); `--help-method` imports the method it describes."""
    import subprocess
    import sys

    code = ("import contextlib, io, sys\n"
            "from posterior_fusion.cli.main import COMMANDS, pfuse\n"
            "for name in COMMANDS:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        pfuse.main([name, '--help'], standalone_mode=False)\n"
            "    assert 'Usage:' in out.getvalue(), name\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout[-500:], out.stderr[-2000:])


def test_the_api_lists_itself_and_names_the_classes(tmp_path, two_clients):
    assert {"load", "GlobalEnsemble", "ModelSpec", "read_data"} <= set(dir(posterior_fusion))
    client = posterior_fusion.load(two_clients[0])
    assert client.class_names == tuple(client.metadata.get("class_names") or ())


def test_no_library_module_does_several_jobs_in_more_than_400_lines():
    """A module does one job: outside ``fusion/methods/`` (one method a module) none passes 400 lines."""
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "posterior_fusion").rglob("*.py"))
            if "fusion/methods/" not in p.as_posix() and (n := len(p.read_text().splitlines())) > 400]
    assert not long, long


def test_no_two_modules_share_a_name():
    """A module's name says what it does, so no two modules of the package (the CLI's included) share one: a second
    ``settings.py`` or ``batchnorm.py`` elsewhere says nothing of how the two differ."""
    seen: dict[str, list[str]] = {}
    for folder in ("posterior_fusion", "cli"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            if p.name != "__init__.py":
                seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, shared


def test_a_test_in_a_package_folder_names_the_module_it_tests_by_its_path():
    """Tests mirror the package: ``tests/<package path>/test_<module>.py`` tests ``posterior_fusion/<package
    path>/<module>.py`` (``tests/flower/test_transfer.py`` → ``posterior_fusion/flower/transfer.py``), so a
    test file in a folder whose module does not exist (renamed, moved) is found here; and no two test files share
    a name (pytest imports them by their names)."""
    wrong, names = [], {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
        folder = p.parent.relative_to(ROOT / "tests")
        if folder.parts:
            module = ROOT / "posterior_fusion" / folder / (p.stem.removeprefix("test_") + ".py")
            if not module.is_file():
                wrong.append(f"{p.relative_to(ROOT)}: no {module.relative_to(ROOT)}")
    assert not wrong, wrong
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}
    assert (ROOT / "tests" / "flower" / "test_transfer.py").is_file()  # the check has something to check


def test_studies_and_benchmarks_import_public_names_that_exist():
    """A study or benchmark reads like a user's script: every name it imports from the package exists (a module
    renamed under it is found here, not when someone reruns it) and none is private (``_name``)."""
    import importlib

    problems = []
    scripts = sorted([*(ROOT / "experiments").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "posterior_fusion":
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                try:
                    module = importlib.import_module(node.module)
                except ImportError as exc:
                    problems.append(f"{where}: {exc}")
                    continue
                for alias in node.names:
                    if alias.name.startswith("_"):
                        problems.append(f"{where}: private name {alias.name}")
                    elif not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            problems.append(f"{where}: {node.module} has no {alias.name}")
    assert not problems, problems


def test_flower_keys_are_read_only_through_their_declared_records():
    """A node-config or run-config key read by hand (``context.node_config.get("x", default)``,
    ``context.run_config["x"]``) carries an inline default or none; every key goes through its record
    (:class:`~posterior_fusion.flower.round_settings.RoundSettings`, ``NodeSettings``, ``FederatedSettings``, the fit
    settings), which declares its default, help and bounds."""
    found = []
    for path in sorted((ROOT / "posterior_fusion" / "flower").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            target = None
            if isinstance(node, ast.Subscript):
                target = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                target = node.func.value
            if isinstance(target, ast.Attribute) and target.attr in ("node_config", "run_config"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
    from posterior_fusion.flower.round_settings import NodeSettings

    with pytest.raises(ConfigError, match="node config setting 'refresh-trust-radius'"):
        NodeSettings.from_node_config({"refresh-trust-radius": "-1"})
    assert NodeSettings.from_node_config({"partition-id": 3, "other": "x"}).partition_id == 3


def test_the_user_facing_api_documents_its_arguments_and_what_it_returns():
    """The functions a user calls first (``posterior_fusion.load``, ``read_data``, ``write_base``, ``fuse``,
    ``plan_fusion``, ``fit_local``) and the methods of what ``load`` returns and of the mixture type have an
    ``Args:`` section naming every argument and, where they return something, a ``Returns:`` section."""
    import inspect

    from posterior_fusion.fusion.from_files import fuse, plan_fusion
    from posterior_fusion.local.fit import fit_local

    targets = [posterior_fusion.load, posterior_fusion.read_data, posterior_fusion.write_base, fuse, plan_fusion,
               fit_local]
    for cls in (posterior_fusion.ClientPosterior, posterior_fusion.Component, posterior_fusion.GlobalEnsemble,
                posterior_fusion.GaussianMixture):
        targets += [getattr(cls, name) for name, v in vars(cls).items()
                    if not name.startswith("_") and (inspect.isfunction(v) or isinstance(v, classmethod))]
    missing = []
    for fn in targets:
        doc = inspect.getdoc(fn) or ""
        sig = inspect.signature(fn)
        args = [p for p in sig.parameters if p not in ("self", "cls")]
        args_section = doc.split("Args:", 1)[1].split("Returns:", 1)[0] if "Args:" in doc else ""
        undocumented = [a for a in args if f"\n    {a}:" not in "\n" + args_section]
        if undocumented:
            missing.append(f"{fn.__qualname__}: Args {undocumented}")
        if sig.return_annotation not in ("None", None, inspect.Signature.empty) and "Returns:" not in doc:
            missing.append(f"{fn.__qualname__}: no Returns")
    assert not missing, missing
    assert len(targets) >= 25  # the scan sees the API


# The flat test files that test no one module: suites across a trust boundary, a user's path or a reference, each
# with what it covers. A new flat file names a top-level module or package of the library, or is added here.
CROSS_CUTTING = {
    "test_design.py": "the architecture itself", "test_packaging.py": "the wheel and a fresh install",
    "test_cli_end_to_end.py": "the command line, command by command", "test_own_data.py": "a newcomer's own data through importers and plugins",
    "test_models_people_have.py": "stock torchvision / transformers models end to end",
    "test_real_models.py": "ResNet-size models end to end", "test_laplace_reference.py": "laplace-torch as the oracle",
    "test_base_prior.py": "the prior centred at a base, fit to fusion", "test_capture_dtype.py": "capture precision",
    "test_capture_inplace.py": "in-place activations under capture", "test_embedding_capture.py": "embeddings' curvature",
    "test_compress_half.py": "float16 compressed factors, writer to reader", "test_dp.py": "differential privacy, fit to fuse",
    "test_pretrained_base.py": "fine-tuning from a base, init to fuse", "test_flower_deployment.py": "a real deployment",
    "test_flower_stop.py": "a deployment's nodes stopped mid-round",
}


def test_a_flat_test_file_names_a_module_or_package_or_says_what_it_crosses():
    flat = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    unnamed = [n for n in flat if n not in CROSS_CUTTING
               and not (ROOT / "posterior_fusion" / (n.removeprefix("test_").removesuffix(".py") + ".py")).is_file()
               and not (ROOT / "posterior_fusion" / n.removeprefix("test_").removesuffix(".py")).is_dir()]
    assert not unnamed, unnamed
    assert not set(CROSS_CUTTING) - set(flat), set(CROSS_CUTTING) - set(flat)  # no stale entry


def test_the_settings_options_of_the_server_and_recapture_commands_are_generated_from_their_declarations():
    """Every option of ``fuse``, ``refresh``, ``recapture``, ``evaluate`` and ``predict`` is either a field of one
    of the command's declared records — its help, default, range and choices the declaration's, none written by
    hand — or one of the files and actions it names here; a setting option added by hand fails this test."""
    import click

    from posterior_fusion.cli.local_commands import recapture_cmd, refresh_cmd
    from posterior_fusion.cli.server_commands import evaluate_cmd, fuse_cmd, predict_cmd
    from posterior_fusion.fusion.distill_settings import RecipeChoice, TeachingConfig
    from posterior_fusion.fusion.options import FusionOptions, ServerSteps
    from posterior_fusion.local.fit_config import fit_settings
    from posterior_fusion.local.recapture_settings import CaptureChoice
    from posterior_fusion.local.refresh_settings import RefreshPrivacy, RefreshStep
    from posterior_fusion.predictive_settings import CalibrationSettings, PredictiveSettings
    from posterior_fusion.settings import describe

    fit = {s.name: s for s in fit_settings()}
    capture_fit = ("capture_dtype", "device", "compress", "compress_metric", "compress_vectors")
    commands = {  # command: (records as (record, prefix, text, help prefix), fit settings, files and actions)
        fuse_cmd: ([(FusionOptions, "", False, ""), (TeachingConfig, "distill_", True, "consistent recipe: "),
                    (RecipeChoice, "distill_", False, ""), (ServerSteps, "", False, "")], (),
                   {"clients", "method", "set_values", "help_method", "out", "val_path", "unlabeled", "distill",
                    "dry_run", "max_memory", "as_json"}),
        refresh_cmd: ([(CaptureChoice, "", False, ""), (RefreshStep, "", False, ""), (RefreshPrivacy, "", True, "")],
                      capture_fit, {"source_path", "data_path", "at_path", "out", "as_json", "max_memory"}),
        recapture_cmd: ([(CaptureChoice, "", False, "")], capture_fit,
                        {"source_path", "data_path", "out", "as_json", "merge", "max_memory"}),
        evaluate_cmd: ([(PredictiveSettings, "", False, ""), (CalibrationSettings, "", False, "")], (),
                       {"global_artifacts", "data_path", "scale_from", "ood", "plot", "as_json", "max_memory"}),
        predict_cmd: ([(PredictiveSettings, "", False, "")], (),
                      {"global_artifact", "data_path", "out", "scale_from", "max_memory"}),
    }
    for cmd, (records, fits, files) in commands.items():
        params = {p.name: p for p in cmd.params if not getattr(p, "hidden", False)}
        declared = set(fits)
        for record, prefix, text, lead in records:
            for row in describe(record):
                if record is FusionOptions and row["name"] == "progress":  # pfuse -q
                    continue
                name = prefix + row["name"]
                declared.add(name)
                p = params[name]
                assert p.help.startswith(lead + row["help"]), (cmd.name, name)
                if text:
                    assert p.default is None, (cmd.name, name)
                    continue
                if not p.is_flag:
                    assert p.default == row["default"], (cmd.name, name)
                if row["choices"]:
                    assert isinstance(p.type, click.Choice) and tuple(p.type.choices) == tuple(row["choices"])
                elif row["bounds"]:
                    assert (p.type.min, p.type.max) == tuple(type(p.type.min)(b) for b in row["bounds"]), name
        for name in fits:
            assert params[name].help.startswith(fit[name].help), (cmd.name, name)
        by_hand = set(params) - declared - files
        assert not by_hand, (cmd.name, by_hand)
        assert not files - set(params), (cmd.name, files - set(params))  # no stale entry


def test_every_settings_record_declares_each_field_once_with_its_help():
    """One settings mechanism: every record a user's setting lands in — the fit, the fusion's shared options, the
    distillation recipes, the refresh round, the capture of a recapture, the predictive, a Flower round and node,
    secure aggregation, the experiment grid — declares each field with :func:`~posterior_fusion.settings.setting`
    (a default and one line of help), and ``pfuse experiment --help`` lists every key of the grid's config."""
    import dataclasses

    from click.testing import CliRunner

    from posterior_fusion.experiment.grid_config import ExperimentConfig
    from posterior_fusion.flower.round_settings import NodeSettings, RoundSettings
    from posterior_fusion.flower.secure import SecureAggregation
    from posterior_fusion.fusion.distill import DistillConfig
    from posterior_fusion.fusion.distill_settings import RecipeChoice, TeachingConfig
    from posterior_fusion.fusion.options import FusionOptions, ServerSteps
    from posterior_fusion.local.fit_config import FitConfig
    from posterior_fusion.local.recapture_settings import CaptureChoice
    from posterior_fusion.local.refresh_settings import RefreshPrivacy, RefreshStep
    from posterior_fusion.predictive_settings import CalibrationSettings, PredictiveSettings

    records = (ExperimentConfig, RoundSettings, NodeSettings, SecureAggregation, DistillConfig, RecipeChoice,
               TeachingConfig, FusionOptions, ServerSteps, CaptureChoice, RefreshPrivacy, RefreshStep,
               PredictiveSettings, CalibrationSettings)
    bare = [f"{r.__name__}.{f.name}" for r in records for f in dataclasses.fields(r) if not f.metadata.get("help")]
    assert not bare, bare
    nested = {"dp", "ppd", "local_model", "train"}  # FitConfig's own records, each declared the same way
    assert not [f.name for f in dataclasses.fields(FitConfig) if not f.metadata.get("help") and f.name not in nested]
    assert ExperimentConfig().fit is not ExperimentConfig().fit  # a table default is each record's own
    from posterior_fusion.cli.main import pfuse

    shown = CliRunner().invoke(pfuse, ["experiment", "--help"]).output
    assert all(f"  {f.name} " in shown for f in dataclasses.fields(ExperimentConfig)), shown


def _records_with_settings() -> list[type]:
    """Every settings record a user's setting lands in: the fit's (nested records included), the fusion's shared
    options, each registered method's, the distillation's, the refresh round's, the predictive's, the Flower
    round's and node's, secure aggregation's, the experiment grid's and the environment's."""
    from posterior_fusion.environment import Environment
    from posterior_fusion.experiment.grid_config import ExperimentConfig
    from posterior_fusion.flower.round_settings import NodeSettings, RoundSettings
    from posterior_fusion.flower.secure import SecureAggregation
    from posterior_fusion.fusion.distill import DistillConfig
    from posterior_fusion.fusion.distill_settings import RecipeChoice, TeachingConfig
    from posterior_fusion.fusion.options import FusionOptions, ServerSteps
    from posterior_fusion.fusion.registry import METHODS
    from posterior_fusion.local.fit_config import DPConfig, FitConfig, LocalModelConfig, PPDConfig, TrainConfig
    from posterior_fusion.local.recapture_settings import CaptureChoice
    from posterior_fusion.local.refresh_settings import RefreshPrivacy, RefreshStep
    from posterior_fusion.local.start_settings import StartSettings
    from posterior_fusion.predictive_settings import CalibrationSettings, PredictiveSettings

    return [Environment, StartSettings, ExperimentConfig, RoundSettings, NodeSettings, SecureAggregation, DistillConfig,
            RecipeChoice, TeachingConfig, FusionOptions, ServerSteps, FitConfig, TrainConfig, DPConfig, PPDConfig,
            LocalModelConfig, CaptureChoice, RefreshPrivacy, RefreshStep, PredictiveSettings, CalibrationSettings,
            *{entry.settings for entry in METHODS.values()}]


def test_every_choice_is_a_string_enum_with_a_one_line_doc_per_value_shown_in_help():
    """Choices are declared as :class:`~posterior_fusion.choices.Choice` enums (a value and its one-line doc, as
    laplace-torch's option enums): every field with choices in every record has a doc for each value, a plain
    tuple is refused at declaration, and ``--help`` / ``--help-method`` show the values' docs."""
    import dataclasses

    from click.testing import CliRunner

    from posterior_fusion.choices import Kernel, KfacType, Structure
    from posterior_fusion.cli.main import pfuse
    from posterior_fusion.fusion.methods.fedbens.fedbens_settings import Solver
    from posterior_fusion.settings import setting

    with_choices = 0
    for record in _records_with_settings():
        for f in dataclasses.fields(record):
            choices, docs = f.metadata.get("choices"), f.metadata.get("choice_docs")
            if choices is None:
                continue
            with_choices += 1
            assert docs is not None and tuple(docs) == tuple(choices), f"{record.__name__}.{f.name}"
            assert all(d.strip() and "\n" not in d for d in docs.values()), f"{record.__name__}.{f.name}"
    assert with_choices >= 30, with_choices
    with pytest.raises(TypeError, match="Choice enum"):
        setting("a", "a plain tuple has no doc per value", choices=("a", "b"))
    assert Structure("diag+full") is Structure.DIAG_FULL and str(Structure.KRON) == "kron" == Structure.KRON

    def flat(args: list[str]) -> str:
        return " ".join(CliRunner().invoke(pfuse, args, terminal_width=10_000).output.split())

    assert f"reduce: {KfacType.REDUCE.doc}" in flat(["fit-local", "--help"])
    assert f"diag+full: {Structure.DIAG_FULL.doc}" in flat(["recapture", "--help"])
    assert f"triton: {Kernel.TRITON.doc}" in flat(["fuse", "--help"])
    assert f"em: {' '.join(Solver.EM.doc.split())}" in flat(["fuse", "--help-method", "fedbens"])


def test_no_module_reads_a_setting_with_a_default_of_its_own():
    """A setting's default lives in its declaration: no library or CLI module reads a fit, fusion, round, node,
    secure-aggregation, grid, capture, predictive or environment setting by hand with a literal default
    (``meta.get("ggn", "exact")``, ``getattr(o, "device", "auto")``) — it takes
    :func:`~posterior_fusion.settings.declared_default` — and no module but ``environment.py`` reads a ``PFUSE_``
    variable."""
    import dataclasses

    from posterior_fusion.environment import Environment
    from posterior_fusion.experiment.grid_config import ExperimentConfig
    from posterior_fusion.flower.round_settings import NodeSettings, RoundSettings
    from posterior_fusion.flower.secure import SecureAggregation
    from posterior_fusion.fusion.options import FusionOptions, ServerSteps
    from posterior_fusion.local.fit_config import fit_settings
    from posterior_fusion.local.recapture_settings import CaptureChoice
    from posterior_fusion.predictive_settings import PredictiveSettings

    names = {s.name for s in fit_settings()} | {f.name for r in (
        Environment, ExperimentConfig, RoundSettings, NodeSettings, SecureAggregation, FusionOptions, ServerSteps,
        CaptureChoice, PredictiveSettings) for f in dataclasses.fields(r)}
    names |= {n.replace("_", "-") for n in names}
    found = []
    for path in sorted([*(ROOT / "posterior_fusion").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
                continue
            fn, key = node.func, node.args[0].value
            by_hand = (isinstance(fn, ast.Attribute) and fn.attr in ("get", "setdefault", "pop")) or (
                isinstance(fn, ast.Name) and fn.id == "getattr")
            if (by_hand and key in names and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value not in (None, "?")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
            if (isinstance(fn, ast.Attribute) and fn.attr in ("get", "getenv") and str(key).startswith("PFUSE_")
                    and path.name != "environment.py"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found
