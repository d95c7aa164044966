"""The Flower server app facing its nodes' replies: typed, checked, over-budget replies skipped, each named by its node."""

from __future__ import annotations

import numpy as np
import pytest

from posterior_fusion.errors import (
    FederationError,
)
from posterior_fusion.flower.server_app import Reply, collect_replies, reply_from_message


class FakeMessage:
    def __init__(self, node, content=None, error=None):
        from flwr.app import RecordDict

        self.metadata = type("Meta", (), {"src_node_id": node})()
        self.content = content if content is not None else RecordDict({})
        self.error = type("Err", (), {"reason": error})() if error else None

    def has_error(self):
        return self.error is not None


def test_flower_replies_are_typed_checked_and_named_by_the_server(tmp_path, kron_artifact):
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from posterior_fusion.flower.transfer import file_fields, message_content

    good = kron_artifact.read_bytes()

    def reply(fields: dict, files: dict | None = None, array=None) -> RecordDict:
        content = message_content("artifact", fields, {"artifact": good} if files is None else files)
        if array is not None:  # the file's bytes replaced by another array, its announced SHA-256 and length kept
            content.array_records["files"] = ArrayRecord({"artifact": Array(array)})
        return content

    changed = bytearray(good)
    changed[len(good) // 2] ^= 1
    msgs = [FakeMessage(11, reply({"partition-id": 0})),
            FakeMessage(12, reply({"partition-id": 0})),          # colliding id: still its own file
            FakeMessage(13, reply({"partition-id": "x"}, array=np.frombuffer(good, np.uint8).astype(np.float32))),
            FakeMessage(14, reply({"partition-id": 1e300})),
            FakeMessage(15, None),
            FakeMessage(16, error="boom"),
            FakeMessage(17, reply({}, array=np.frombuffer(bytes(changed), np.uint8))),  # a chunk changed
            FakeMessage(18, RecordDict({"artifact": ConfigRecord(file_fields("artifact", good))})),  # bytes lost
            FakeMessage(19, reply({}, files={}))]
    replies = [reply_from_message(k, m) for k, m in enumerate(msgs)]
    assert [r.reported_partition_id for r in replies[:4]] == [0, 0, None, None]
    logs = []
    paths = collect_replies(replies, tmp_path / "out", "skip", logs.append)
    assert [p.name for p in paths] == ["client_0.h5", "client_1.h5", "client_3.h5"]
    assert (tmp_path / "out" / "client_0.h5").read_bytes() == good
    assert any("client 2: reply rejected (file 'artifact' must be" in m and "as a uint8 array" in m for m in logs)
    assert any("client 4: reply rejected (reply has no valid 'artifact' record" in m for m in logs)
    assert any("client 6: reply rejected (file 'artifact' is not the bytes its SHA-256 names" in m for m in logs)
    assert any("client 7: reply rejected (file 'artifact' is announced" in m and "missing" in m for m in logs)
    assert any("client 8: reply rejected (reply carries no file 'artifact')" in m for m in logs)
    small = reply_from_message(0, msgs[0], max_memory=3 * len(good) - 3)
    assert small.blob is None and "more than the" in small.error
    with pytest.raises(FederationError, match="distinct"):
        collect_replies([Reply(0, good), Reply(0, good)], tmp_path / "dup", "skip", logs.append)
    # second names after the reported partition: only an id claimed by exactly one accepted node
    from posterior_fusion.flower.server_app import name_by_silo

    out = tmp_path / "out"
    (out / "silo_7.h5").symlink_to(tmp_path / "elsewhere.h5")  # an earlier round's name: replaced, not followed
    replies[3].reported_partition_id = 7
    named = name_by_silo(replies, paths, out, logs.append)
    assert named == {"client_3.h5": "silo_7.h5"} and not (out / "silo_0.h5").exists()
    assert any("all report partition id 0: no silo_0.h5" in m for m in logs)
    assert not (out / "silo_7.h5").is_symlink() and (out / "silo_7.h5").samefile(out / "client_3.h5")
    assert not (tmp_path / "elsewhere.h5").exists()


def test_flower_reply_over_the_memory_budget_is_skipped(tmp_path, kron_artifact):
    good = kron_artifact.read_bytes()
    logs = []
    with pytest.raises(FederationError, match="no valid"):
        collect_replies([Reply(0, good)], tmp_path / "cap", "skip", logs.append, max_memory=1000)
    assert any("over the limit" in m for m in logs)


class NodesInProcess:
    """Stands in for Flower's Grid: every train message is answered by :func:`client_train` on the node's own
    silo, in this process (no SuperLink, no Ray)."""

    def __init__(self, silos: dict[int, object], state):
        self.silos, self.state, self.pushed = silos, state, []

    def get_node_ids(self):
        return sorted(self.silos)

    def push_messages(self, messages):
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"id-{len(self.pushed)}"
            self.pushed.append(m)
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        from flwr.app import Context, RecordDict

        from posterior_fusion.flower import client_train

        out = []
        for m in self.pushed:
            if m.metadata.message_id in message_ids:
                node = m.metadata.dst_node_id
                ctx = Context(run_id=1, node_id=node, node_config={"silo": str(self.silos[node]),
                                                                   "state-dir": str(self.state / str(node))},
                              state=RecordDict(), run_config={})
                out.append(client_train(m, ctx))
        return out


def test_a_round_that_distils_serves_the_student_the_files_path_teaches(tmp_path, small_silo, monkeypatch):
    """Run config ``distill`` (and ``distill-*``, the same settings as ``fuse --distill``'s): after the collection
    the fused predictive teaches one network on the server's unlabeled inputs, and ``global.h5`` serves the very
    student that ``fuse --distill`` teaches from the same artifacts as files; a recipe key without ``distill``, a
    consistent-recipe key with ``swa`` and ``swa`` without unlabeled inputs are each one line before any message;
    a secure round refuses ``distill``."""
    from flwr.supercore.task_identity import TaskIdentity

    import posterior_fusion
    from posterior_fusion.data.silo import SiloData, write_silo
    from posterior_fusion.errors import ConfigError
    from posterior_fusion.flower import FederatedSettings
    from posterior_fusion.flower.apps import check_secure_run_config, distill_from_run_config
    from posterior_fusion.flower.round_settings import RoundSettings
    from posterior_fusion.flower.server_app import run_round
    from posterior_fusion.fusion import FusionOptions, fuse

    for field in ("_run_id", "_node_id", "_task_id"):
        if getattr(TaskIdentity, field) is None:
            monkeypatch.setattr(TaskIdentity, field, 1)
    x, y = small_silo.x, small_silo.y
    silos = {}
    for node in (11, 12):
        k = node - 11
        silos[node] = tmp_path / f"silo_{node}.h5"
        write_silo(silos[node], SiloData(x[k * 100:(k + 1) * 100], y[k * 100:(k + 1) * 100], "fmnist", 10))
    write_silo(tmp_path / "unlabeled.h5", SiloData(x[200:300], None, "fmnist", 10))
    cfg = {"distill": True, "unlabeled": str(tmp_path / "unlabeled.h5"), "distill-steps": "12",
           "distill-batch-size": 16, "distill-ema": "0", "method": "ensemble", "distill-views": 2,
           "distill-student": '{"name": "mlp", "kwargs": {"hidden": 12}}'}
    r = RoundSettings.from_run_config(cfg)
    teach = distill_from_run_config(cfg, r)
    assert (teach.steps, teach.batch_size, teach.ema, teach.lr) == (12, 16, 0.0, 2e-3)  # the rest declared defaults
    assert teach.views == 2 and "hidden" in teach.student
    settings = FederatedSettings(model="mlp", model_kwargs={"hidden": 8}, components=1, structure="diag", epochs=1,
                                 batch_size=32)
    out = tmp_path / "round"
    grid = NodesInProcess(silos, tmp_path / "state")
    meta = run_round(grid, settings, out, "ensemble", FusionOptions(progress=False), unlabeled_path=r.unlabeled,
                     distill=teach, log=lambda m: None)
    served = posterior_fusion.load(out / "global.h5")
    assert meta["distill"]["recipe"] == "consistent" and len(served.members) == 1
    assert served.model_spec.kwargs["hidden"] == 12  # the student's own model, not the clients' (hidden 8)
    _, ref, ref_meta = fuse(sorted(out.glob("client_*.h5")), "ensemble", FusionOptions(progress=False),
                            unlabeled_path=tmp_path / "unlabeled.h5", distill=teach)
    assert len(ref.members) == 1 and ref.members[0].equal(served.members[0])
    assert ref_meta["distill"]["agreement"] == meta["distill"]["agreement"]

    for bad, match in (({"distill-steps": 5}, "applies with `distill`"),
                       ({"distill": True, "distill-recipe": "swa", "distill-steps": 5, "unlabeled": "u.h5"},
                        "setting of the consistent recipe"),
                       ({"distill": True, "distill-recipe": "swa"}, "needs unlabeled server data"),
                       ({"distill": True, "distill-lr": "fast"}, "distill_lr")):
        with pytest.raises(ConfigError, match=match):
            distill_from_run_config(bad, RoundSettings.from_run_config(bad))
    with pytest.raises(ConfigError, match="`distill` needs each client's artifact"):
        check_secure_run_config(RoundSettings.from_run_config({"secure-aggregation": True, "distill": True}))
