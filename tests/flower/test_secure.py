"""Fusion from sums over clients (FedAvg, Fisher merge, the diagonal product) and its secure round on Flower's
SecAgg+: each method's sums path against a dense float64 reference, the node's refusals, and a simulated round whose
global equals the exact fusion of the nodes' own artifacts while the server receives no artifact and no unmasked
statistics."""

from __future__ import annotations

import hashlib

import pytest
import torch
from conftest import fit_split

import posterior_fusion
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import ConfigError, FederationError
from posterior_fusion.files import user_data_folder
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.fusion.client_sums import sum_over_clients, sums_context
from posterior_fusion.fusion.registry import METHODS
from posterior_fusion.fusion.types import FusionInputs

flwr = pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'posterior-fusion[flower]'")

from posterior_fusion.flower import FederatedSettings  # noqa: E402
from posterior_fusion.flower.secure import (  # noqa: E402
    SecureAggregation,
    check_secure_round,
    run_secure_round,
    secure_statistics,
)


@pytest.fixture(scope="module")
def diag_clients(tmp_path_factory, fmnist_train):
    x, y = fmnist_train
    silo = SiloData(x[:360], y[:360], "fmnist", 10)
    return fit_split(tmp_path_factory.mktemp("sums"), silo, 3, 120, "diag", kwargs={"hidden": 4}, mixtures=1)


def dense_reference(clients, method: str) -> torch.Tensor:
    """The method's fused weights from dense float64 matrices built from the loaded artifacts."""
    n = torch.tensor([float(c.n_data) for c in clients], dtype=torch.float64)
    W = [c.components[0].map.double() for c in clients]
    if method == "fedavg":
        return sum(nc * w for nc, w in zip(n, W)) / n.sum()
    if method == "fisher-merge":
        F = [torch.diag(c.components[0].curvature.diagonal().double()) for c in clients]
        return torch.linalg.solve(sum(F), sum(f @ w for f, w in zip(F, W)))
    lam0 = clients[0].prior_precision
    P = [torch.diag(c.components[0].curvature.diagonal().double()) / c.temperature
         + lam0 * torch.eye(len(W[0]), dtype=torch.float64) for c in clients]
    total = sum(P) - (len(clients) - 1) * lam0 * torch.eye(len(W[0]), dtype=torch.float64)
    return torch.linalg.solve(total, sum(p @ w for p, w in zip(P, W)))


@pytest.mark.parametrize("method", ["fedavg", "fisher-merge", "product"])
def test_each_method_from_sums_equals_a_dense_reference(diag_clients, method):
    clients = [posterior_fusion.load(p) for p in diag_clients]
    expected = dense_reference(clients, method)
    _, result, _ = fuse(diag_clients, method, FusionOptions(progress=False))
    torch.testing.assert_close(result.members[0].double(), expected, rtol=1e-5, atol=1e-6)
    entry = METHODS[method]
    inputs = FusionInputs(clients, FusionOptions(progress=False))
    sums = sum_over_clients(inputs, entry.sums, entry.settings())
    from_sums = entry.sums.finish(sums, sums_context(inputs), entry.settings()).members[0]
    torch.testing.assert_close(from_sums.double(), expected, rtol=1e-5, atol=1e-6)


def test_a_node_refuses_statistics_out_of_range_and_the_server_refuses_what_sums_cannot_do(diag_clients):
    fusion = {"method": "product", "component": 0, "temperature": None, "prior_var": None}
    stats, n, public = secure_statistics(diag_clients[0], fusion, 1e6, 1e6)
    assert n == 120 and public["input_transform"] is not None and all(s.ndim == 1 for s in stats)
    with pytest.raises(FederationError, match="secure-aggregation-clipping-range"):
        secure_statistics(diag_clients[0], fusion, 1e-6, 1e6)
    with pytest.raises(FederationError, match="secure-aggregation-max-weight"):
        secure_statistics(diag_clients[0], fusion, 1e6, 100)
    with pytest.raises(ConfigError, match="cannot run under secure aggregation"):
        check_secure_round("ensemble", "kron", None, None)
    with pytest.raises(ConfigError, match="structure diag only"):
        check_secure_round("product", "kron", None, None)
    with pytest.raises(ConfigError, match="run config `base`"):
        check_secure_round("fedavg", "diag", "a" * 64, None)
    check_secure_round("fisher-merge", "kron", None, None)  # the diagonal of any curvature
    from posterior_fusion.flower.apps import check_secure_run_config
    from posterior_fusion.flower.round_settings import RoundSettings

    for key in ("refresh", "robust"):
        with pytest.raises(ConfigError, match=f"`{key}`"):
            check_secure_run_config(RoundSettings.from_run_config({key: True}))
    with pytest.raises(ConfigError, match="secure-aggregation-reconstruction-threshold"):
        SecureAggregation.from_run_config({"secure-aggregation-reconstruction-threshold": 0.2})


class RecordingGrid:
    """The server's grid, recording every reply it receives."""

    def __init__(self, grid) -> None:
        self._grid, self.replies = grid, []

    def send_and_receive(self, messages, *args, **kwargs):
        replies = list(self._grid.send_and_receive(messages, *args, **kwargs))
        self.replies += replies
        return replies

    def __getattr__(self, name):
        return getattr(self._grid, name)


@pytest.mark.parametrize("case", ["product, diag, random starts", "fisher-merge, kron, a base's head"])
def test_a_secure_round_equals_the_exact_fusion_and_the_server_sees_no_artifact(tmp_path, fmnist_train, monkeypatch,
                                                                                case):
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from posterior_fusion.flower import client_train
    from posterior_fusion.flower.secure import secure_sums_mod
    from posterior_fusion.local.init import write_base
    from posterior_fusion.models import ModelSpec

    x, y = fmnist_train
    silos = tmp_path / "silos"
    silos.mkdir()
    for c in range(3):
        write_silo(silos / f"client_{c}.h5", SiloData(x[c * 150 : (c + 1) * 150], y[c * 150 : (c + 1) * 150], "fmnist", 10))
    method, base = case.split(",")[0], None
    fit = {"model": "mlp", "model_kwargs": {"hidden": 8}, "components": 1, "init_seed": 2, "epochs": 1,
           "batch_size": 32, "train_seed": 1}
    if "base" in case:
        torch.manual_seed(5)
        model = ModelSpec("mlp", {"hidden": 8}).build()
        base = tmp_path / "base.safetensors"
        sha = write_base(model, base)
        settings = FederatedSettings(**fit, structure="kron", finetune="head", base_sha256=sha)
    else:
        settings = FederatedSettings(**fit, structure="diag")
    out = tmp_path / "flower"
    server, grids = ServerApp(), []

    @server.main()
    def main(grid, context):
        grids.append(RecordingGrid(grid))
        run_secure_round(grids[0], context, settings, out, method, FusionOptions(progress=False), {},
                         SecureAggregation(max_weight=200), min_nodes=3, base=base)

    client = ClientApp()

    @client.train(mods=[secure_sums_mod])
    def train(msg, context):
        if base is not None and int(context.node_config["partition-id"]) == 0:
            context.node_config["base"] = str(base)  # its own copy (deployment: --node-config base=...); the others
            # train from the copy the server sent with the fit instructions
        return client_train(msg, context, silo_dir=silos)

    monkeypatch.chdir(tmp_path)
    run_simulation(server, client, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    g = posterior_fusion.load(out / "global.h5")
    assert g.metadata["secure_aggregation"]["clients"] == 3 and g.metadata["secure_aggregation"]["n_data"] == 450
    assert sorted(p.name for p in out.iterdir()) == ["global.h5"]  # no client artifact on the server
    # the nodes' own artifacts (kept in their state folders) fused exactly, on files
    own = []
    for c in range(3):
        key = hashlib.sha256(str((silos / f"client_{c}.h5").resolve()).encode()).hexdigest()[:16]
        state = user_data_folder() / "posterior-fusion" / "node" / key
        own += sorted(state.glob("*.h5"), key=lambda p: p.stat().st_mtime)[-1:]
    assert len(own) == 3
    _, exact, _ = fuse(own, method, FusionOptions(progress=False))
    torch.testing.assert_close(g.members[0], exact.members[0], rtol=0, atol=1e-5)
    if base is not None:  # the global is the fine-tuning spec: the base's frozen weights, the fused head
        assert g.metadata["base_sha256"] == sha and g.model_spec == posterior_fusion.load(own[0]).model_spec
        assert g.members[0].numel() == 8 * 10 + 10
    # every reply the server received: no artifact, no array (SecAgg+ sends the masked vector as bytes)
    replies = grids[0].replies
    assert replies and all("artifact" not in r.content.config_records for r in replies if not r.has_error())
    assert all(len(a) == 0 for r in replies if not r.has_error() for a in r.content.array_records.values())
    masked = [r for r in replies if not r.has_error()
              and any("masked" in k for rec in r.content.config_records.values() for k in rec)]
    assert len(masked) == 3


def test_a_private_node_sends_its_guarantee_in_the_clear_and_its_statistics_are_post_processing(tmp_path, small_silo):
    pytest.importorskip("opacus", reason="differential privacy needs the `dp` extra (opacus)")
    from click.testing import CliRunner

    from posterior_fusion.cli.main import pfuse

    write_silo(tmp_path / "s.h5", SiloData(small_silo.x[:120, ::2, ::2].copy(), small_silo.y[:120], "fmnist", 10))
    r = CliRunner().invoke(pfuse, ["fit-local", "--data", str(tmp_path / "s.h5"), "--model", "mlp", "--model-kwargs",
                                   '{"in_features": 196, "hidden": 8}', "-M", "1", "--epochs", "1", "--structure",
                                   "diag", "--dp", "--out", str(tmp_path / "p.h5")])
    assert r.exit_code == 0, r.output
    dp = posterior_fusion.load(tmp_path / "p.h5").metadata["dp"]
    stats, n, public = secure_statistics(tmp_path / "p.h5", {"method": "fisher-merge"}, 1e6, 1e6)
    assert public["dp"] == {"epsilon": dp["epsilon"], "delta": dp["delta"]} and len(stats) == 4, (public, dp)
    assert n == posterior_fusion.load(tmp_path / "p.h5").n_data  # the released count, not the silo's exact one
