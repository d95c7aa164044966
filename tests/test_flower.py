"""Flower: one-round simulation equals the file-based path; bad replies are left out or stop the run."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

import posterior_fusion
from posterior_fusion.data.silo import SiloData, write_silo
from posterior_fusion.errors import ConfigError, FederationError, IncompatibleArtifactsError
from posterior_fusion.fusion import FusionOptions, fuse

flwr = pytest.importorskip("flwr", reason="Flower is an optional extra: pip install 'posterior-fusion[flower]'")

from flwr.app import Message, RecordDict  # noqa: E402

from posterior_fusion.flower import (  # noqa: E402
    FederatedSettings,
    Reply,
    client_refresh,
    client_train,
    collect_replies,
    fit_to_artifact,
    make_server_app,
)
from posterior_fusion.flower.transfer import message_content, received_file  # noqa: E402


def artifact_of(reply: Message) -> bytes:
    """The artifact file a node's reply carries (its length and SHA-256 checked)."""
    return received_file(reply.content, reply.content["artifact"], "artifact")


@pytest.fixture
def task_identity(monkeypatch):
    """Messages built outside a Flower run need a run and node id (flwr sets them inside a run; without this the
    tests building messages by hand passed only after a simulation test had run in the same process)."""
    from flwr.supercore.task_identity import TaskIdentity

    for field in ("_run_id", "_node_id", "_task_id"):
        if getattr(TaskIdentity, field) is None:
            monkeypatch.setattr(TaskIdentity, field, 1)


SETTINGS = FederatedSettings(model="mlp", model_kwargs={"hidden": 16}, components=2, init_seed=3, structure="kron",
                             epochs=1, batch_size=32, train_seed=1)
OPTIONS = FusionOptions(progress=False)
FUSE_SETTINGS = {"steps": 10, "val_every": 5}


def test_collect_replies_policies(tmp_path, kron_artifact):
    good = kron_artifact.read_bytes()
    corrupt = good[: len(good) // 2]
    replies = [Reply(2, corrupt), Reply(0, good), Reply(1, None, "node error: out of memory")]
    logs = []
    paths = collect_replies(replies, tmp_path / "a", "skip", logs.append)
    assert [p.name for p in paths] == ["client_0.h5"]
    assert any("client 2: reply rejected (invalid artifact" in m for m in logs)
    assert any("client 1: reply rejected (node error: out of memory)" in m for m in logs)
    assert not (tmp_path / "a" / "client_2.h5").exists()
    with pytest.raises(FederationError, match="client 1: reply rejected"):
        collect_replies(replies, tmp_path / "b", "fail", logs.append)
    with pytest.raises(FederationError, match="no valid client artifact"):
        collect_replies([Reply(0, corrupt)], tmp_path / "c", "skip", logs.append)


def test_simulation_equals_file_path_and_skips_corrupt_reply(tmp_path, fmnist_train, monkeypatch):
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    from flwr.app import Message
    from flwr.clientapp import ClientApp
    from flwr.simulation import run_simulation

    x, y = fmnist_train
    silos = tmp_path / "silos"
    silos.mkdir()
    for c in range(4):
        write_silo(silos / f"client_{c}.h5", SiloData(x[c * 150 : (c + 1) * 150], y[c * 150 : (c + 1) * 150], "fmnist", 10))
    write_silo(tmp_path / "val.h5", SiloData(x[-100:], y[-100:], "fmnist", 10))

    def train_corrupting_node_3(msg, context):
        reply = client_train(msg, context, silo_dir=silos)
        rec = reply.content["artifact"]
        if int(rec["partition-id"]) == 3:  # a node that sends a broken artifact, announced as such
            blob = bytearray(artifact_of(reply))
            blob[len(blob) // 2 :] = b"\0" * (len(blob) - len(blob) // 2)
            return Message(message_content("artifact", {"partition-id": 3}, {"artifact": bytes(blob)}), reply_to=msg)
        return reply

    client = ClientApp()
    client.train()(train_corrupting_node_3)
    client.query()(lambda msg, context: client_refresh(msg, context, silo_dir=silos))
    out = tmp_path / "flower"
    server = make_server_app(SETTINGS, out, "fedbens", OPTIONS, tmp_path / "val.h5", "skip", min_nodes=4,
                             method_settings=FUSE_SETTINGS, refresh=True, refresh_damping="auto")
    monkeypatch.chdir(tmp_path)
    run_simulation(server, client, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    g = posterior_fusion.load(out / "global.h5")
    clients = g.metadata["federation"]["clients"]  # files named by the server, in node-id order
    assert len(clients) == 3 and sorted(c["reported_partition_id"] for c in clients) == [0, 1, 2]
    assert len(list(out.glob("client_*.h5"))) == 3

    files = []
    for c in range(3):
        files.append(tmp_path / f"file_{c}.h5")
        fit_to_artifact(SETTINGS, silos / f"client_{c}.h5", files[-1])
    flower_file = {c["reported_partition_id"]: out / c["file"] for c in clients}
    assert all((out / f"silo_{p}.h5").samefile(flower_file[p]) for p in range(3))  # named after the silo too
    assert sorted(c["silo_file"] for c in clients) == ["silo_0.h5", "silo_1.h5", "silo_2.h5"]
    for a, b in zip(files, [flower_file[p] for p in range(3)]):
        ca, cb = posterior_fusion.load(a).components, posterior_fusion.load(b).components
        for u, v in zip(ca, cb, strict=True):
            torch.testing.assert_close(v.map, u.map, rtol=1e-5, atol=1e-6)  # Ray actors run single-threaded
    _, ref, _ = fuse(files, "fedbens", OPTIONS, FUSE_SETTINGS, val_path=tmp_path / "val.h5")
    for u, v in zip(ref.members, g.members, strict=True):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5)

    # the refresh round: each accepted node refreshed its own artifact at global.h5 privately (the node's default:
    # a fresh noisy gradient, its own curvature), as `pfuse refresh` does on files; the server fused those
    g2 = posterior_fusion.load(out / "global_refreshed.h5")
    info = g2.metadata["federation"]["refresh"]
    assert len(info["accepted"]) == 3 and info["left_out"] == [] and info["damping"] == "auto"
    refreshed = []
    for c in clients:
        theirs = posterior_fusion.load(out / "refresh" / c["file"])
        own = posterior_fusion.load(out / c["file"])
        assert theirs.metadata["refreshed_at"]["file_sha256"] == g.sha256
        assert theirs.metadata["refreshed_at"]["dp"]["epsilon"] <= 1.0  # the node's default privacy
        for v in theirs.components:
            assert v.training["gain_test"] == "not run"
            torch.testing.assert_close(v.curvature.diagonal(), own.components[v.training["curvature_from"]].curvature
                                       .damped(own.n_data, v.training["damping"]).diagonal())
        refreshed.append(out / "refresh" / c["file"])
    _, ref2, _ = fuse(refreshed, "fedbens", OPTIONS, FUSE_SETTINGS, val_path=tmp_path / "val.h5")
    for u, v in zip(ref2.members, g2.members, strict=True):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5)


def test_the_refresh_handler_recaptures_only_its_own_artifact_within_its_trust_radius(tmp_path, small_silo,
                                                                                        task_identity):
    """The node's train handler keeps its artifact; the refresh handler recaptures that copy, named by hash,
    at a global near it, and refuses (one line, nothing sent back) a global whose member lies beyond the
    node's own trust radius — a point the server chose far from the silo's posterior."""
    from flwr.app import ConfigRecord, Context

    from posterior_fusion.artifact import write_global_artifact
    from posterior_fusion.local.refresh import TRUST_RADIUS, distance_from_own_posterior

    silo = tmp_path / "s.h5"
    write_silo(silo, SiloData(small_silo.x[:120], small_silo.y[:120], "fmnist", 10))
    ctx = Context(run_id=1, node_id=1, node_config={"silo": str(silo), "state-dir": str(tmp_path / "st")},
                  state=RecordDict(), run_config={})
    small = FederatedSettings(model="mlp", model_kwargs={"hidden": 4}, components=1, structure="diag", epochs=1)
    train = Message(RecordDict({"config": ConfigRecord({"settings": small.to_json()})}), dst_node_id=1,
                    message_type="train")
    blob = artifact_of(client_train(train, ctx))
    sha = hashlib.sha256(blob).hexdigest()
    assert (tmp_path / "st" / f"{sha}.h5").read_bytes() == blob
    own = posterior_fusion.load(tmp_path / "st" / f"{sha}.h5")
    w = own.components[0].map
    gen = torch.Generator().manual_seed(0)
    near, far = w + 0.01 * torch.randn(w.numel(), generator=gen), w + torch.randn(w.numel(), generator=gen)
    assert distance_from_own_posterior(own, near) <= TRUST_RADIUS < distance_from_own_posterior(own, far)
    for members, ok in (((near,), True), ((near, far), False)):
        g = tmp_path / "g.h5"
        write_global_artifact(g, own.model_spec, own.layout, {"method": "fedavg"}, list(members))
        msg = Message(message_content("refresh", {"own-sha256": sha, "damping": 1.0}, {"global": g.read_bytes()}),
                      dst_node_id=1, message_type="query")
        if ok:
            (tmp_path / "r.h5").write_bytes(artifact_of(client_refresh(msg, ctx)))
            assert posterior_fusion.load(tmp_path / "r.h5").metadata["refreshed_at"]["members"] == 1
        else:
            with pytest.raises(IncompatibleArtifactsError, match="member 1 lies at .* beyond the trust radius"):
                client_refresh(msg, ctx)


def test_example_run_config_carries_fit_and_fusion_settings():
    from pathlib import Path

    import tomllib
    from flwr.common.config import flatten_dict

    from posterior_fusion.flower.apps import fusion_from_run_config
    from posterior_fusion.fusion import method_settings

    example = Path(__file__).resolve().parents[1] / "examples" / "flower" / "pyproject.toml"
    flat = flatten_dict(tomllib.loads(example.read_text())["tool"]["flwr"]["app"]["config"])
    method, options, settings, robust = fusion_from_run_config(flat)
    chosen = method_settings(method, settings)
    assert (method, chosen.steps, chosen.val_every, robust) == ("fedbens", 300, 30, False)
    fit = FederatedSettings.from_run_config(flat)
    assert fit.components == 3 and fit.swag_rank == 20 and fit.fit_config().train.swag_rank == 20
    from posterior_fusion.local.refresh_settings import check_damping
    assert check_damping(flat["refresh-damping"], "refresh-damping") == "auto"


def test_a_bad_refresh_damping_is_refused_before_the_round(tmp_path):
    """``refresh-damping`` is checked before any message is sent: a word other than auto, a negative or
    a non-finite number, a boolean — one ConfigError naming the key."""
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.flower.server_app import run_round

    grid = FakeGrid([])
    for bad in ("often", -1.0, float("inf"), True):
        with pytest.raises(ConfigError, match="refresh-damping must be 'auto' or a finite number"):
            run_round(grid, SETTINGS, tmp_path / "out", refresh=True, refresh_damping=bad)
    assert grid.pushed == []


def test_example_is_a_current_flower_app_without_legacy_connection_tables():
    """flwr 1.41 moves connections to its own config; a ``[tool.flwr.federations]`` table makes
    ``flwr run`` rewrite the user's pyproject.toml ("legacy usage")."""
    from pathlib import Path

    from flwr.cli.config_utils import load_and_validate

    example = Path(__file__).resolve().parents[1] / "examples" / "flower" / "pyproject.toml"
    config, warnings = load_and_validate(example, check_module=True)  # the components import
    assert warnings == []
    assert "federations" not in config["tool"]["flwr"]


class FakeGrid:
    """Stands in for Flower's Grid: message ids are set in place by push; replies come per pull."""

    def __init__(self, replies_per_pull, node_ids=()):
        self.replies_per_pull = list(replies_per_pull)  # list of lists of (index, src_node_id or None)
        self.pushed = []
        self.node_ids = list(node_ids)

    def get_node_ids(self):
        return self.node_ids

    def push_messages(self, messages):
        for i, m in enumerate(messages):
            m.metadata.__dict__["_message_id"] = f"id-{i}"
            self.pushed.append(m)
        return [f"id-{i}" for i in range(len(messages))]

    def pull_messages(self, message_ids):
        from flwr.app import Error

        batch = self.replies_per_pull.pop(0) if self.replies_per_pull else []
        out = []
        for i, src in batch:
            if f"id-{i}" not in set(message_ids):
                continue
            if src is None:  # the SuperLink's "node unavailable" reply: its source is not the node
                r = Message(Error(code=0, reason="Node Unavailable"), reply_to=self.pushed[i])
            else:
                r = Message(RecordDict(), reply_to=self.pushed[i])
            out.append(r)
        return out


def test_exchange_matches_replies_by_message_and_times_out(task_identity):
    from posterior_fusion.flower.server_app import exchange

    def messages(n):
        return [Message(RecordDict(), dst_node_id=100 + i, message_type="train") for i in range(n)]

    # node 1's answer is Flower's own unavailability error; node 2 never answers
    grid = FakeGrid([[(0, 100)], [(1, None)], [], []])
    replies, missing = exchange(grid, messages(3), [0, 1, 2], timeout_s=0.05, log=lambda m: None, poll_s=0.01)
    assert sorted(replies) == [0, 1] and replies[1].has_error()
    assert list(missing) == [2] and "timeout" in missing[2]
    # no timeout: waits until every message is answered
    grid = FakeGrid([[], [(2, 102)], [], [(0, 100), (1, 101)]])
    replies, missing = exchange(grid, messages(3), [5, 6, 7], timeout_s=0, log=lambda m: None, poll_s=0.0)
    assert sorted(replies) == [5, 6, 7] and missing == {}


def test_ppd_settings_and_a_node_s_local_model():
    from types import SimpleNamespace

    from posterior_fusion.flower.client_app import node_local_model

    cfg = FederatedSettings(ppd=True, ppd_steps=50, ppd_burn_in=10).fit_config()
    assert cfg.ppd is not None and (cfg.ppd.steps, cfg.ppd.burn_in) == (50, 10)
    assert FederatedSettings().fit_config().ppd is None
    node = SimpleNamespace(node_config={"local-model": "mlp", "local-model-kwargs": '{"hidden": 7}',
                                        "local-model-weight": 0.3})
    private = node_local_model(node)
    assert (private.model, private.model_kwargs, private.epochs, private.weight) == ("mlp", {"hidden": 7}, None, 0.3)
    assert node_local_model(SimpleNamespace(node_config={})) is None
    from posterior_fusion.errors import ConfigError

    with pytest.raises(ConfigError, match="local-model-kwargs"):
        node_local_model(SimpleNamespace(node_config={"local-model": "mlp", "local-model-kwargs": "{bad"}))


def test_importing_the_flower_integration_silences_rays_notice_only():
    """Ray's "Tip: In future versions of Ray …" FutureWarning (printed by every simulation's ray.init)
    is filtered once the integration is imported; other FutureWarnings still show."""
    import subprocess
    import sys

    code = ("import warnings, posterior_fusion.flower\n"
            "warnings.warn('Tip: In future versions of Ray, Ray will no longer override accelerator visible "
            "devices env var', FutureWarning)\n"
            "warnings.warn('another future change', FutureWarning)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"})
    assert out.returncode == 0, out.stderr
    assert "Tip: In future versions of Ray" not in out.stderr and "another future change" in out.stderr


def test_a_run_that_fine_tunes_a_base_uses_the_node_s_copy_checked_by_hash(tmp_path, small_silo, task_identity):
    """Run config base-sha256: the node trains from its own copy of the base (node config 'base') with the prior
    centred there; a node without a copy, or with another file, refuses in one line before training; the server
    leaves out a reply fine-tuned from another base (or from none)."""
    from flwr.app import ConfigRecord, Context
    from safetensors.torch import save_file
    from torch.nn.utils import parameters_to_vector

    from posterior_fusion.models import ModelSpec

    silo = tmp_path / "s.h5"
    write_silo(silo, SiloData(small_silo.x[:120], small_silo.y[:120], "fmnist", 10))
    bases = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = ModelSpec("mlp", {"hidden": 4}).build()
        path = tmp_path / f"base{seed}.safetensors"
        save_file({k: v.detach().clone() for k, v in model.named_parameters()}, str(path))
        bases.append((path, parameters_to_vector(model.parameters()).detach(), hashlib.sha256(path.read_bytes()).hexdigest()))
    run = FederatedSettings(model="mlp", model_kwargs={"hidden": 4}, components=1, structure="diag", epochs=1,
                            base_sha256=bases[0][2])
    assert FederatedSettings.from_json(run.to_json()) == run
    assert FederatedSettings.from_run_config({"model": "mlp", "model-kwargs": '{"hidden": 4}', "components": 1,
                                              "base-sha256": bases[0][2]}).base_sha256 == bases[0][2]
    with pytest.raises(ConfigError, match="base-sha256 must be"):
        FederatedSettings(base_sha256="not a hash")
    train = Message(RecordDict({"config": ConfigRecord({"settings": run.to_json()})}), dst_node_id=1,
                    message_type="train")

    def node(base):
        config = {"silo": str(silo), "state-dir": str(tmp_path / "st")} | ({"base": str(base)} if base else {})
        return Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})

    blob = artifact_of(client_train(train, node(bases[0][0])))
    (tmp_path / "c.h5").write_bytes(blob)
    art = posterior_fusion.load(tmp_path / "c.h5")
    assert art.metadata["init"]["base_sha256"] == bases[0][2] and torch.equal(art.prior_mean, bases[0][1])
    head = FederatedSettings(model="mlp", model_kwargs={"hidden": 4}, components=1, structure="diag", epochs=1,
                             base_sha256=bases[0][2], finetune="head")  # a fit setting: it travels as every other
    blob_head = artifact_of(client_train(Message(RecordDict({"config": ConfigRecord({"settings": head.to_json()})}), dst_node_id=1,
                                     message_type="train"), node(bases[0][0])))
    (tmp_path / "h.h5").write_bytes(blob_head)
    assert posterior_fusion.load(tmp_path / "h.h5").layout.names == ["3.weight", "3.bias"]
    with pytest.raises(ConfigError, match="node config 'base'"):
        client_train(train, node(None))
    with pytest.raises(IncompatibleArtifactsError, match="is not the base"):
        client_train(train, node(bases[1][0]))
    logs = []
    scratch = artifact_of(client_train(Message(RecordDict({"config": ConfigRecord({"settings": FederatedSettings(
        model="mlp", model_kwargs={"hidden": 4}, components=1, structure="diag", epochs=1).to_json()})}),
        dst_node_id=1, message_type="train"), node(None)))
    paths = collect_replies([Reply(0, blob), Reply(1, scratch)], tmp_path / "srv", "skip", logs.append,
                            base_sha256=bases[0][2])
    assert [p.name for p in paths] == ["client_0.h5"]
    assert any("client 1: reply rejected (fine-tuned from no base, the run asks for the base" in m for m in logs)


def test_the_server_sends_its_copy_of_the_base_once_and_a_node_checks_it_by_hash(tmp_path, small_silo, task_identity):
    """Run config ``base``: the server checks its copy (it fits the model, its SHA-256 is the run's) before any
    message and sends its bytes in every train message; a node without a copy trains from them — the artifact the
    one a node with its own copy writes — and keeps them in its state folder; bytes with another
    SHA-256 are refused in one line; a node that names its own copy uses it, whatever the server sent."""
    from flwr.app import Context
    from safetensors.torch import save_file

    from posterior_fusion.errors import FederationError
    from posterior_fusion.flower.server_app import run_round
    from posterior_fusion.models import ModelSpec

    silo = tmp_path / "s.h5"
    write_silo(silo, SiloData(small_silo.x[:120], small_silo.y[:120], "fmnist", 10))
    bases = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        path = tmp_path / f"base{seed}.safetensors"
        save_file({k: v.detach().clone() for k, v in ModelSpec("mlp", {"hidden": 4}).build().named_parameters()},
                  str(path))
        bases.append((path, hashlib.sha256(path.read_bytes()).hexdigest()))
    run = FederatedSettings(model="mlp", model_kwargs={"hidden": 4}, components=1, structure="diag", epochs=1,
                            base_sha256=bases[0][1])
    other = FederatedSettings(model="mlp", model_kwargs={"hidden": 5}, components=1, base_sha256=bases[0][1])
    grid = FakeGrid([], node_ids=[7])
    with pytest.raises(IncompatibleArtifactsError, match="is not the run's base"):
        run_round(grid, run, tmp_path / "out", base=bases[1][0])
    with pytest.raises(IncompatibleArtifactsError, match=r"base0\.safetensors"):  # another model spec
        run_round(grid, other, tmp_path / "out", base=bases[0][0])
    with pytest.raises(ConfigError, match="fine-tunes no base"):
        run_round(grid, FederatedSettings(model="mlp", model_kwargs={"hidden": 4}), tmp_path / "out", base=bases[0][0])
    assert grid.pushed == []
    with pytest.raises(FederationError, match="no valid client artifact"):
        run_round(grid, run, tmp_path / "out", base=bases[0][0], round_timeout=0.01, log=lambda m: None)
    pushed = grid.pushed[0].content
    sent = received_file(pushed, pushed["config"], "base")
    assert sent == bases[0][0].read_bytes()

    def train(blob, node_config):
        content = message_content("config", {"settings": run.to_json()}, {"base": blob} if blob is not None else {})
        msg = Message(content, dst_node_id=1, message_type="train")
        ctx = Context(run_id=1, node_id=1, node_config={"silo": str(silo)} | node_config, state=RecordDict(),
                      run_config={})
        return artifact_of(client_train(msg, ctx))

    def same_fit(a: bytes, b: bytes) -> bool:
        (tmp_path / "a.h5").write_bytes(a)
        (tmp_path / "b.h5").write_bytes(b)
        x, y = posterior_fusion.load(tmp_path / "a.h5"), posterior_fusion.load(tmp_path / "b.h5")
        return (x.metadata["init"]["base_sha256"] == y.metadata["init"]["base_sha256"] == bases[0][1]
                and torch.equal(x.prior_mean, y.prior_mean) and torch.equal(x.components[0].map, y.components[0].map))

    own = train(None, {"state-dir": str(tmp_path / "own"), "base": str(bases[0][0])})
    assert same_fit(train(sent, {"state-dir": str(tmp_path / "sent")}), own)
    assert (tmp_path / "sent" / f"base-{bases[0][1]}.safetensors").read_bytes() == sent
    assert same_fit(train(bases[1][0].read_bytes(), {"state-dir": str(tmp_path / "pinned"),
                                                     "base": str(bases[0][0])}), own)
    with pytest.raises(FederationError, match="the base the server sent has SHA-256"):
        train(bases[1][0].read_bytes(), {"state-dir": str(tmp_path / "wrong")})
    with pytest.raises(ConfigError, match="or the server's run config 'base'"):
        train(None, {"state-dir": str(tmp_path / "none")})


def test_run_config_settings_of_another_method_are_named_and_not_used(capsys):
    from posterior_fusion.flower.apps import fusion_from_run_config

    method, _, settings, _ = fusion_from_run_config({"method": "fedavg", "set.steps": 300})
    assert (method, settings) == ("fedavg", {}) and "set.steps is not a setting of fedavg: not used" in capsys.readouterr().out
    _, _, settings, _ = fusion_from_run_config({"method": "fedbens", "set.steps": 300})
    assert settings == {"steps": 300} and capsys.readouterr().out == ""


def test_a_pfuse_error_in_the_server_app_ends_in_its_one_line():
    """Flower logs what a ServerApp raises with its traceback: a refused run config is raised from the app's
    entry with the traceback cut to that one frame and no chained cause, so the log ends in the one line."""
    from flwr.app import Context, RecordDict

    from posterior_fusion.errors import ConfigError
    from posterior_fusion.flower import apps

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"method": "product", "secure-aggregation": True, "refresh": True})
    with pytest.raises(ConfigError, match="`refresh`") as caught:
        apps.main(None, context)
    frames, tb = [], caught.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-1] == "main" and "serve" not in frames and "check_secure_run_config" not in frames, frames
    assert caught.value.__suppress_context__ and caught.value.__cause__ is None


def test_the_node_state_folder_is_the_node_users_own(tmp_path, monkeypatch):
    """The default state folder lies under the user's data folder, created 0700; a folder that is a symbolic link
    (planted by another local user), another user's or open to others is refused in one line."""
    import os
    import stat

    from flwr.app import Context, RecordDict

    from posterior_fusion.errors import OutputError
    from posterior_fusion.flower.client_app import node_state_dir

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    silo = tmp_path / "silo.h5"
    silo.write_bytes(b"")

    def ctx(config):
        return Context(run_id=1, node_id=1, node_config=config, state=RecordDict(), run_config={})

    state = node_state_dir(ctx({"silo": str(silo)}), silo)
    assert str(state).startswith(str(tmp_path / "data" / "posterior-fusion" / "node"))
    assert stat.S_IMODE(os.lstat(state).st_mode) == 0o700
    target = tmp_path / "someone_elses"
    target.mkdir(mode=0o700)
    (tmp_path / "linked").symlink_to(target)
    with pytest.raises(OutputError, match="symbolic link"):
        node_state_dir(ctx({"silo": str(silo), "state-dir": str(tmp_path / "linked")}), silo)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o755)
    with pytest.raises(OutputError, match="open to other users"):
        node_state_dir(ctx({"silo": str(silo), "state-dir": str(open_folder)}), silo)
    monkeypatch.setattr(os, "getuid", lambda: 12345)
    with pytest.raises(OutputError, match="another user"):
        node_state_dir(ctx({"silo": str(silo), "state-dir": str(state)}), silo)


@pytest.mark.parametrize("field, value", [("components", "5"), ("components", 10**19), ("init_seed", "7"),
                                          ("init_seed", 10**19), ("components", 0)])
def test_server_sent_settings_are_checked_with_the_cli_ranges(field, value):
    """What the server sends (component count, init seed) is refused in one ConfigError line on the node, never a
    traceback from deep inside the fit."""
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.flower.federated_settings import FederatedSettings

    with pytest.raises(ConfigError, match=field.replace("_", "-")):
        FederatedSettings.from_json(json.dumps({"model": "mlp", field: value}))


def test_the_round_keys_are_declared_once_and_read_typed():
    """The server's round keys come from one declaration (``flower/round_settings.py``): a key left out takes its
    declared default, a value is converted to its declared type, and one out of its range or choices, or of the
    wrong type, is refused in one line naming the key."""
    from posterior_fusion.flower.round_settings import RoundSettings
    from posterior_fusion.settings import describe

    declared = {row["name"]: row["default"] for row in describe(RoundSettings)}
    assert RoundSettings.from_run_config({}) == RoundSettings(**declared)
    r = RoundSettings.from_run_config({"min-nodes": "3", "round-timeout": 5, "refresh": "true", "base": ""})
    assert (r.min_nodes, r.round_timeout, r.refresh, r.base) == (3, 5.0, True, None)
    for cfg, key in (({"min-nodes": 0}, "min-nodes"), ({"on-bad-reply": "retry"}, "on-bad-reply"),
                     ({"min-nodes": 1.5}, "min-nodes"), ({"refresh": "maybe"}, "refresh")):
        with pytest.raises(ConfigError, match=key):
            RoundSettings.from_run_config(cfg)
