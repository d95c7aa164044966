"""One-round federated fit-local + fuse on Flower (``pip install posterior-fusion[flower]``).

The ClientApp's train handler runs the same :func:`~posterior_fusion.local.fit.fit_components`
as ``pfuse fit-local`` on the node's silo and replies with the artifact's bytes. The
ServerApp sends the shared settings to every node, validates each reply with the same
reader as files (a bad or missing reply is logged and left out, or stops the run, per
``on_bad_reply``), runs :func:`~posterior_fusion.fusion.registry.fuse` and saves the global
artifact plus the client artifacts it used.

Refresh round (``refresh``, a "1.5-shot" exchange): the server then sends each accepted node a
training-free ``query`` message with the global artifact and the SHA-256 of the node's own first
artifact; the node recaptures *its own copy* of that artifact — kept on its disk since the first
round (node config ``state-dir``, default a per-silo folder under the system's temporary folder) —
never one the server sends, so model, structure, T and λ0 are the node's; the global is checked
against it first (:func:`~posterior_fusion.local.recapture.check_refresh_global`: the same model, at
most ``-M``'s cap of members, each within the node's trust radius — node config
``refresh-trust-radius``, the server cannot set it). It runs ``pfuse recapture --at`` on its silo
(``refresh_damping``) — private by the node's own settings (node config ``refresh-dp-epsilon``,
``refresh-dp-delta``, ``refresh-dp-clip``; ``refresh-dp-epsilon = "none"`` releases the exact gradient and a
new curvature; the server cannot set them either) — and replies with the refreshed artifact,
which the server validates like the first and fuses again into ``global_refreshed.h5`` (the one-shot
``global.h5`` stays). A node that fails the second message is left out of the refreshed fusion.

Which silo a node trains on: ``node_config["silo"]`` (deployment: ``flower-supernode
--node-config 'silo="/data/client_0.h5"'``), else ``<silo-dir>/client_<partition-id>.h5`` in
simulation (Flower sets ``partition-id``), with ``silo-dir`` from ``make_client_app(silo_dir)``
or the run config.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from posterior_fusion import budget, ranges
from posterior_fusion.artifact import load_client
from posterior_fusion.compat import RENAMED_RUN_CONFIG_KEYS, rename_keys
from posterior_fusion.errors import (
    ArtifactError,
    ConfigError,
    FederationError,
    IncompatibleArtifactsError,
    PfuseError,
    ResourceLimitError,
)
from posterior_fusion.files import check_output, write_atomically
from posterior_fusion.flower.base import base_to_send, node_base
from posterior_fusion.flower.secure import is_secure_fit, secure_fit_reply, secure_sums_mod
from posterior_fusion.fusion import FusionOptions, fuse, write_fused
from posterior_fusion.fusion.settings import MethodSettings
from posterior_fusion.local.config import (
    FitConfig,
    PrivateModelConfig,
    fit_config_from,
    fit_settings,
    refresh_privacy_from,
)
from posterior_fusion.local.fit import fit_silo_file
from posterior_fusion.local.recapture import REFRESH_DAMPING, TRUST_RADIUS, check_damping, recapture_to_file
from posterior_fusion.models import ModelSpec

BAD_REPLY_POLICIES = ("skip", "fail")


class FederatedSettings:
    """What the server sends to every node: the model, M, the init seed and every fit setting of
    ``pfuse fit-local`` (:func:`~posterior_fusion.local.config.fit_settings`, declared once: a
    setting added there is a run-config key here too), except the private model, which each node
    chooses in its own node config."""

    def __init__(self, model: str = "lenet", model_kwargs: dict | None = None, components: int = 5,
                 init_seed: int = 0, base_sha256: str | None = None, **fit: Any) -> None:
        table = _server_fit_settings()
        unknown = sorted(set(fit) - set(table))
        if unknown:
            raise ConfigError(f"no fit setting {', '.join(map(repr, unknown))}; the fit settings: {', '.join(table)}")
        self.model, self.model_kwargs = model, dict(model_kwargs or {})
        self.components, self.init_seed = components, init_seed
        if base_sha256 is not None and (not isinstance(base_sha256, str) or len(base_sha256) != 64
                                        or any(ch not in "0123456789abcdef" for ch in base_sha256)):
            raise ConfigError("base-sha256 must be the 64 hexadecimal digits of the base file's SHA-256")
        self.base_sha256 = base_sha256
        self.fit = {name: fit.get(name, s.default) for name, s in table.items()}

    def __getattr__(self, name: str) -> Any:
        fit = self.__dict__.get("fit", {})
        if name in fit:
            return fit[name]
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FederatedSettings) and self.to_json() == other.to_json()

    def to_json(self) -> str:
        base = {"base_sha256": self.base_sha256} if self.base_sha256 else {}
        return json.dumps({"model": self.model, "model_kwargs": self.model_kwargs, "components": self.components,
                           "init_seed": self.init_seed, **base, **self.fit}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FederatedSettings:
        try:
            obj = json.loads(text)
            return cls(**{k.replace("-", "_"): v for k, v in
                          rename_keys(obj, RENAMED_RUN_CONFIG_KEYS, "federated settings", print).items()})
        except (json.JSONDecodeError, TypeError, AttributeError) as exc:
            raise ConfigError(f"invalid federated settings: {exc}") from None

    @classmethod
    def from_run_config(cls, cfg: dict[str, Any]) -> FederatedSettings:
        """Settings from a Flower run config (keys as in examples/flower/pyproject.toml: the fit
        settings' names with ``-``)."""
        cfg = rename_keys(cfg, RENAMED_RUN_CONFIG_KEYS, "run config", print)
        kwargs = json.loads(str(cfg.get("model-kwargs", "{}")))
        keys = {"model": "model", "components": "components", "init-seed": "init_seed", "base-sha256": "base_sha256",
                **{s.run_config_key: name for name, s in _server_fit_settings().items()}}
        return cls(model_kwargs=kwargs, **{name: cfg[key] for key, name in keys.items() if key in cfg})

    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, dict(self.model_kwargs))

    def fit_config(self) -> FitConfig:
        return fit_config_from(self.fit, "federated settings: ")


def _server_fit_settings() -> dict:
    return {s.name: s for s in fit_settings() if s.path[0] != "private"}


def fit_to_artifact(settings: FederatedSettings, silo_path: str | os.PathLike, out: str | os.PathLike,
                    log: Callable[[str], None] = lambda m: None, private: PrivateModelConfig | None = None,
                    base: str | os.PathLike | None = None) -> None:
    """The work of one silo: exactly what ``pfuse fit-local --init-seed S`` does (``private``:
    the node's own architecture, HBFL's heterogeneous client — chosen by the node, not the server), or,
    when the run names a base by its SHA-256, what ``pfuse init --from BASE`` + ``fit-local --init`` do with
    the node's own copy ``base`` (node config ``base``), refused in one line unless its SHA-256 is the run's."""
    cfg = settings.fit_config()
    if private is not None:
        cfg = replace(cfg, private=private)
        cfg.validate()
    if settings.base_sha256 and base is None:
        raise ConfigError(f"the run fine-tunes the base {settings.base_sha256[:12]}…: set this node's node config "
                          "'base' to its copy of the base file, or the server's run config 'base' to send it")
    fit_silo_file(settings.spec(), silo_path, out, settings.components, settings.init_seed, cfg, log=log,
                  base=base if settings.base_sha256 else None, base_sha256=settings.base_sha256)


def node_private_model(context: Context) -> PrivateModelConfig | None:
    """The node's own architecture from its node config (``private-model``, ``private-model-kwargs``,
    ``private-epochs``, ``private-weight``), or None."""
    nc = context.node_config
    if "private-model" not in nc:
        return None
    try:
        kwargs = json.loads(str(nc.get("private-model-kwargs", "{}")))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"node config private-model-kwargs is not valid JSON: {exc.msg}") from None
    spec = ModelSpec(str(nc["private-model"]), kwargs)
    epochs = nc.get("private-epochs")
    return PrivateModelConfig(spec.name, dict(spec.kwargs), int(epochs) if epochs is not None else None,
                              float(nc.get("private-weight", 0.5)))


def node_silo(context: Context, silo_dir: str | os.PathLike | None = None) -> Path:
    if "silo" in context.node_config:
        return Path(str(context.node_config["silo"]))
    folder = silo_dir if silo_dir is not None else context.run_config.get("silo-dir")
    if "partition-id" in context.node_config and folder is not None:
        return Path(str(folder)) / f"client_{int(context.node_config['partition-id'])}.h5"
    raise ConfigError("this node has no silo: set node_config 'silo', or a silo-dir with partition-id")


def node_state_dir(context: Context, silo: Path) -> Path:
    """Where the node keeps its own artifacts between rounds: node config ``state-dir``, else
    ``<temporary folder>/pfuse-node/<hash of the silo's path>``."""
    if "state-dir" in context.node_config:
        return Path(str(context.node_config["state-dir"]))
    key = hashlib.sha256(str(silo.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "pfuse-node" / key


def client_train(msg: Message, context: Context, silo_dir: str | os.PathLike | None = None) -> Message:
    """ClientApp train handler: fit the node's silo (from the run's base, when it fine-tunes one: the node's own
    copy or the one the message carries, :func:`~posterior_fusion.flower.base.node_base`), keep the artifact in the
    node's state folder (named by its SHA-256, for the refresh round) and reply with its bytes — or, in the secure aggregation's
    round, with the fusion method's statistics only (:func:`~posterior_fusion.flower.secure.secure_fit_reply`)."""
    secure = is_secure_fit(msg)
    config = msg.content.config_records["fitins.config" if secure else "config"]
    settings = FederatedSettings.from_json(str(config["settings"]))
    silo = node_silo(context, silo_dir)
    state = node_state_dir(context, silo)
    base = node_base(dict(context.node_config), settings.base_sha256, config.get("base"), state)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "client.h5"
        fit_to_artifact(settings, silo, out, private=node_private_model(context), base=base)
        blob = out.read_bytes()
    state.mkdir(parents=True, exist_ok=True)
    own = state / f"{hashlib.sha256(blob).hexdigest()}.h5"
    write_atomically(own, lambda tmp_path: tmp_path.write_bytes(blob))
    if secure:  # only the method's statistics leave, masked by SecAgg+ (flower/secure.py)
        return secure_fit_reply(msg, own)
    reply = {"artifact": blob, "silo": str(silo)}
    if "partition-id" in context.node_config:
        reply["partition-id"] = int(context.node_config["partition-id"])
    return Message(RecordDict({"artifact": ConfigRecord(reply)}), reply_to=msg)


def client_refresh(msg: Message, context: Context, silo_dir: str | os.PathLike | None = None) -> Message:
    """ClientApp query handler, the refresh round: recapture the node's own artifact at the global
    artifact's members on its silo, reply with the refreshed artifact's bytes (as ``train`` does)."""
    rec = msg.content["refresh"]
    if "artifact" in rec:
        raise FederationError("a refresh message may name the node's own artifact by 'artifact-sha256', never send "
                              "one: the node recaptures only its own copy")
    own, at, damping = rec.get("artifact-sha256"), rec.get("global"), rec.get("damping")
    if not isinstance(own, str) or len(own) != 64 or any(ch not in "0123456789abcdef" for ch in own):
        raise FederationError("a refresh message needs 'artifact-sha256', the SHA-256 of the node's own artifact")
    if not isinstance(at, bytes):
        raise FederationError("a refresh message needs the bytes of 'global'")
    if damping != "auto" and (isinstance(damping, bool) or not isinstance(damping, (int, float))):
        raise FederationError(f"a refresh message's 'damping' must be 'auto' or a number, got {type(damping).__name__}")
    damping = check_damping(damping, "the refresh message's damping")
    radius = context.node_config.get("refresh-trust-radius", TRUST_RADIUS)
    if isinstance(radius, str):
        try:
            radius = float(radius)
        except ValueError:
            pass
    ranges.check("node config refresh-trust-radius", radius, ranges.TRUST_RADIUS)
    privacy = refresh_privacy_from({k.replace("-", "_"): v for k, v in context.node_config.items()
                                    if k.startswith("refresh-dp-")}, "node config: ")
    silo = node_silo(context, silo_dir)
    first = node_state_dir(context, silo) / f"{own}.h5"
    if not first.is_file():
        raise FederationError(f"this node holds no artifact with SHA-256 {own[:16]}… (it recaptures only its own, "
                              f"kept in {first.parent} since the first round)")
    with tempfile.TemporaryDirectory() as tmp:
        glob, out = Path(tmp) / "global.h5", Path(tmp) / "refreshed.h5"
        glob.write_bytes(at)
        recapture_to_file(first, silo, out, None, at_path=glob, damping=damping, log=lambda m: None,
                          trust_radius=float(radius), privacy=privacy)
        blob = out.read_bytes()
    reply = {"artifact": blob, "silo": str(silo)}
    if "partition-id" in context.node_config:
        reply["partition-id"] = int(context.node_config["partition-id"])
    return Message(RecordDict({"artifact": ConfigRecord(reply)}), reply_to=msg)


def make_client_app(silo_dir: str | os.PathLike | None = None) -> ClientApp:
    """ClientApp whose train handler is :func:`client_train` and query handler (the refresh round)
    :func:`client_refresh` (``silo_dir``: simulation default)."""
    app = ClientApp()

    def train(msg: Message, context: Context) -> Message:
        return client_train(msg, context, silo_dir)

    def query(msg: Message, context: Context) -> Message:
        return client_refresh(msg, context, silo_dir)

    app.train(mods=[secure_sums_mod])(train)
    app.query()(query)
    return app


@dataclass
class Reply:
    """A node's answer, Flower-independent. ``key`` is assigned by the server (the node's
    index in sorted node-id order) and names the file; nothing the node sent names anything.
    ``reported_partition_id`` is what the node claimed, kept for information only."""

    key: int
    blob: bytes | None
    error: str | None = None
    node_id: int | None = None
    reported_partition_id: int | None = None


def reply_from_message(key: int, msg: Message) -> Reply:
    """Type-check a reply's fields; anything unexpected becomes an error reply (never an exception)."""
    node = msg.metadata.src_node_id
    if msg.has_error():
        return Reply(key, None, f"node error: {str(msg.error.reason)[:200]}", node)
    try:
        rec = msg.content["artifact"]
        blob = rec["artifact"] if "artifact" in rec else None
        pid = rec["partition-id"] if "partition-id" in rec else None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return Reply(key, None, f"reply has no valid 'artifact' record ({type(exc).__name__})", node)
    if not isinstance(blob, bytes):
        return Reply(key, None, f"field 'artifact' must be bytes, got {type(blob).__name__}", node)
    reported = pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 1 << 31 else None
    return Reply(key, blob, None, node, reported)


def collect_replies(replies: list[Reply], out_dir: Path, on_bad_reply: str = "skip",
                    log: Callable[[str], None] = print, max_memory: int | str | None = None,
                    base_sha256: str | None = None) -> list[Path]:
    """Write each reply's bytes to ``out_dir/client_<key>.h5`` and validate it as a file.

    A reply with an error, no bytes, bytes over the memory budget, an artifact the reader
    refuses, or one fine-tuned from another base than ``base_sha256`` (None: from no base) is logged and
    left out (``skip``) or stops the run (``fail``). Keys are the
    server's own; two replies with one key are refused. Returns the accepted paths, ordered by key.
    """
    if on_bad_reply not in BAD_REPLY_POLICIES:
        raise ConfigError(f"on_bad_reply must be one of {BAD_REPLY_POLICIES}")
    keys = [r.key for r in replies]
    if len(set(keys)) != len(keys) or not all(isinstance(k, int) and k >= 0 for k in keys):
        raise FederationError("reply keys must be distinct non-negative integers chosen by the server")
    out_dir.mkdir(parents=True, exist_ok=True)
    accepted = []
    for r in sorted(replies, key=lambda r: r.key):
        path = out_dir / f"client_{r.key}.h5"
        problem = r.error or (None if r.blob else "empty reply")
        if problem is None:
            def checked(tmp: Path, blob: bytes = r.blob) -> None:  # validated before it takes the name
                tmp.write_bytes(blob)
                init = load_client(tmp, max_memory).metadata.get("init")
                got = init.get("base_sha256") if isinstance(init, dict) else None
                if got != base_sha256:
                    said = lambda sha: f"the base {str(sha)[:12]}…" if sha else "no base"  # noqa: E731
                    raise IncompatibleArtifactsError(f"fine-tuned from {said(got)}, the run asks for {said(base_sha256)}")

            try:
                budget.require(3 * len(r.blob), f"checking the reply of client {r.key}", max_memory)
                write_atomically(path, checked)
                accepted.append(path)
                continue
            except ArtifactError as exc:
                problem = f"invalid artifact: {exc.reason} [{exc.hdf5_path}]"
            except (ResourceLimitError, IncompatibleArtifactsError) as exc:
                problem = str(exc)
        r.error = problem
        message = f"client {r.key}: reply rejected ({problem})"
        if on_bad_reply == "fail":
            raise FederationError(message)
        log(message + "; continuing without it")
    if not accepted:
        raise FederationError("no valid client artifact was received")
    return accepted


def name_by_silo(replies: list[Reply], accepted: list[Path], out_dir: Path,
                 log: Callable[[str], None] = print) -> dict[str, str]:
    """Give each accepted file a second name after the partition its node reported: a hard link
    ``out_dir/silo_<id>.h5`` to the server's ``client_<key>.h5`` (which stays the name of record), for
    every id reported by exactly one accepted node (ids are integers checked on receipt, so the
    name is always a plain file name in ``out_dir``). Links of an earlier round are replaced, never
    followed. Returns ``{client file: silo file}``."""
    names = {p.name for p in accepted}
    ok = [r for r in replies if f"client_{r.key}.h5" in names and r.reported_partition_id is not None]
    claims: dict[int, list[Reply]] = {}
    for r in ok:
        claims.setdefault(r.reported_partition_id, []).append(r)
    out = {}
    for pid, rs in sorted(claims.items()):
        if len(rs) > 1:
            log(f"clients {', '.join(str(r.key) for r in rs)} all report partition id {pid}: no silo_{pid}.h5")
            continue
        target, link = out_dir / f"client_{rs[0].key}.h5", out_dir / f"silo_{pid}.h5"
        tmp = out_dir / f".silo_{pid}.h5.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        os.link(target, tmp)
        os.replace(tmp, link)  # replaces an earlier link (or a symlink) itself
        out[target.name] = link.name
    return out


def exchange(grid: Grid, messages: list[Message], keys: list[int], timeout_s: float = 0.0,
             log: Callable[[str], None] = print, poll_s: float = 1.0) -> tuple[dict[int, Message], dict[int, str]]:
    """Send ``messages`` (the k-th for server key ``keys[k]``) and collect the replies.

    Replies are matched by the id of the message they answer (Flower's own "node unavailable"
    error replies come from the SuperLink, not from the node). Waits until every message is
    answered, or ``timeout_s`` seconds (0 = no limit), logging every 30 s how many replied and which nodes
    are still working.
    Returns ``(replies by key, why each other key is missing)``.
    """
    returned = {str(i) for i in grid.push_messages(messages) if i}
    nodes = {str(m.metadata.message_id or ""): m.metadata.dst_node_id for m in messages}
    waiting, missing = {}, {}
    for key, m in zip(keys, messages):
        mid = str(m.metadata.message_id or "")
        if mid and mid in returned:
            waiting[mid] = key
        else:
            missing[key] = "the SuperLink did not accept the message for this node"
    replies: dict[int, Message] = {}
    t0 = last = time.time()
    while waiting and (timeout_s <= 0 or time.time() - t0 < timeout_s):
        for m in grid.pull_messages(list(waiting)):
            key = waiting.pop(str(m.metadata.reply_to_message_id), None)
            if key is None:
                log("ignoring a reply to no message of this round")
                continue
            replies[key] = m
        if waiting:
            if time.time() - last >= 30:
                last = time.time()
                busy = sorted(nodes.get(mid, "?") for mid in waiting)
                log(f"{len(replies)} of {len(messages)} node(s) replied; still working: node "
                    f"{', '.join(map(str, busy[:8]))}{', …' if len(busy) > 8 else ''} ({last - t0:.0f}s)")
            time.sleep(poll_s)
    for key in waiting.values():
        missing[key] = f"no reply within the round timeout ({timeout_s:g}s)"
    return replies, missing


def nodes_left_out(ids: list[int], missing: dict[int, str], replies: list[Reply], accepted: list[Path]) -> list[dict]:
    """``{node_id, key, reason}`` of every node of a round that sent nothing or whose reply was refused."""
    names = {p.name for p in accepted}
    out = [{"node_id": ids[k], "key": k, "reason": why} for k, why in missing.items()]
    out += [{"node_id": ids[r.key], "key": r.key, "reason": r.error or "rejected"}
            for r in replies if f"client_{r.key}.h5" not in names]
    return out


def run_round(grid: Grid, settings: FederatedSettings, out_dir: str | os.PathLike, method: str | None = None,
              options: FusionOptions | None = None, val_path: str | os.PathLike | None = None,
              on_bad_reply: str = "skip", min_nodes: int = 1, wait_s: float = 120.0,
              log: Callable[[str], None] = print,
              method_settings: MethodSettings | Mapping[str, Any] | None = None,
              max_memory: int | str | None = None, robust: bool = False, round_timeout: float = 0.0,
              refresh: bool = False, refresh_damping: float | str = REFRESH_DAMPING,
              base: str | os.PathLike | None = None) -> dict:
    """Server side of the round: send settings, collect artifacts, fuse, write ``global.h5``.

    Client files are named by the server (``client_<k>.h5``, k = the node's index in sorted
    node-id order), never from reply content; a file whose node reported a partition id no other
    node reported also gets the name ``silo_<id>.h5`` (a hard link: :func:`name_by_silo`). ``round_timeout``: seconds to wait for replies
    (0 = until every node answered or Flower reported it unavailable). The global artifact's
    metadata ``federation.left_out`` records every node left out and why. ``refresh``: a second,
    training-free exchange (module docstring) and ``global_refreshed.h5``; its metadata
    ``federation.refresh`` records the nodes, bytes moved and who was left out. ``base``: the server's copy of
    the base the run fine-tunes, checked and sent once in every train message
    (:func:`~posterior_fusion.flower.base.base_to_send`; a node with its own copy uses that)."""
    if on_bad_reply not in BAD_REPLY_POLICIES:
        raise ConfigError(f"on-bad-reply must be one of {BAD_REPLY_POLICIES}, got {on_bad_reply!r}")
    if isinstance(round_timeout, bool) or not (isinstance(round_timeout, (int, float)) and round_timeout >= 0):
        raise ConfigError(f"round-timeout must be a number of seconds >= 0, got {round_timeout!r}")
    refresh_damping = check_damping(refresh_damping, "refresh-damping")
    server_base = base_to_send(settings.spec(), settings.base_sha256, base, max_memory)
    sent = None if server_base is None else server_base[0]
    out = Path(out_dir)
    check_output(out / "global.h5")
    if refresh:
        check_output(out / "global_refreshed.h5")
    t0 = time.time()
    ids = sorted(grid.get_node_ids())
    while len(ids) < min_nodes and time.time() - t0 < wait_s:
        time.sleep(0.2)
        ids = sorted(grid.get_node_ids())
    if len(ids) < min_nodes:
        raise FederationError(f"only {len(ids)} of {min_nodes} nodes connected within {wait_s:.0f}s")
    content = RecordDict({"config": ConfigRecord({"settings": settings.to_json(),
                                                  **({"base": sent} if sent is not None else {})})})
    messages = [Message(content, dst_node_id=i, message_type="train") for i in ids]
    log(f"sent settings{' and the base' if sent is not None else ''} to {len(messages)} nodes")
    answers, missing = exchange(grid, messages, list(range(len(ids))), float(round_timeout), log)
    if missing:
        if on_bad_reply == "fail":
            raise FederationError(f"{len(missing)} node(s) did not reply: "
                                  + "; ".join(f"node {ids[k]}: {why}" for k, why in sorted(missing.items())))
        log(f"{len(missing)} node(s) did not reply; continuing without them")
    replies = [reply_from_message(k, m) for k, m in sorted(answers.items())]
    paths = collect_replies(replies, out, on_bad_reply, log, max_memory, settings.base_sha256)
    silo_files = name_by_silo(replies, paths, out, log)
    inputs, result, meta = fuse(paths, method, options or FusionOptions(progress=False), method_settings,
                                val_path, log=log, max_memory=max_memory, robust=robust)
    by_name = {f"client_{r.key}.h5": r for r in replies}
    left_out = nodes_left_out(ids, missing, replies, paths)
    meta["federation"] = {"engine": "flower", "nodes": len(ids), "accepted": [p.name for p in paths],
                          "clients": [{"file": p.name, "node_id": by_name[p.name].node_id,
                                       "reported_partition_id": by_name[p.name].reported_partition_id,
                                       "silo_file": silo_files.get(p.name)}
                                      for p in paths],
                          "left_out": sorted(left_out, key=lambda d: d["key"]),
                          "settings": json.loads(settings.to_json())}
    write_fused(out / "global.h5", inputs, result, meta)
    gone = ", ".join(f"node {d['node_id']}" for d in meta["federation"]["left_out"])
    log(f"wrote {out / 'global.h5'} from {len(paths)} client artifacts" + (f"; left out: {gone}" if gone else ""))
    if refresh:
        return refresh_round(grid, ids, paths, out, method, options, val_path, on_bad_reply, log, method_settings,
                             max_memory, float(round_timeout), refresh_damping, meta)
    return meta


def refresh_round(grid: Grid, ids: list[int], paths: list[Path], out: Path, method: str,
                  options: FusionOptions | None, val_path, on_bad_reply: str, log: Callable[[str], None],
                  method_settings, max_memory, round_timeout: float, damping: float | str, first_meta: dict) -> dict:
    """The refresh round's server side: ``global.h5`` and each accepted node's own artifact out in a
    ``query`` message, the refreshed artifacts back (validated as in the first round, written to
    ``out/refresh/``), fused again into ``global_refreshed.h5``. Returns its metadata."""
    at = (out / "global.h5").read_bytes()
    keys = [int(p.stem.split("_")[1]) for p in paths]  # client_<key>.h5, the server's own names
    messages = [Message(RecordDict({"refresh": ConfigRecord({"global": at, "damping": damping, "artifact-sha256":
                                                             hashlib.sha256(p.read_bytes()).hexdigest()})}),
                        dst_node_id=ids[k], message_type="query") for k, p in zip(keys, paths)]
    log(f"refresh round: sent the global artifact to {len(messages)} nodes")
    answers, missing = exchange(grid, messages, keys, round_timeout, log)
    if missing and on_bad_reply == "fail":
        raise FederationError(f"{len(missing)} node(s) did not answer the refresh round: "
                              + "; ".join(f"node {ids[k]}: {why}" for k, why in sorted(missing.items())))
    replies = [reply_from_message(k, m) for k, m in sorted(answers.items())]
    refreshed = collect_replies(replies, out / "refresh", on_bad_reply, log, max_memory,
                                first_meta["federation"]["settings"].get("base_sha256"))
    inputs, result, meta = fuse(refreshed, method, options or FusionOptions(progress=False), method_settings,
                                val_path, log=log, max_memory=max_memory)
    left_out = nodes_left_out(ids, missing, replies, refreshed)
    meta["federation"] = dict(first_meta["federation"])
    meta["federation"]["refresh"] = {"damping": damping, "accepted": [f"refresh/{p.name}" for p in refreshed],
                                     "bytes_down_per_node": len(at),
                                     "bytes_up": sum(p.stat().st_size for p in refreshed),
                                     "left_out": sorted(left_out, key=lambda d: d["key"])}
    write_fused(out / "global_refreshed.h5", inputs, result, meta)
    log(f"wrote {out / 'global_refreshed.h5'} from {len(refreshed)} refreshed client artifacts")
    return meta


def make_server_app(settings: FederatedSettings, out_dir: str | os.PathLike, method: str | None = None,
                    options: FusionOptions | None = None, val_path: str | os.PathLike | None = None,
                    on_bad_reply: str = "skip", min_nodes: int = 1,
                    method_settings: MethodSettings | Mapping[str, Any] | None = None,
                    refresh: bool = False, refresh_damping: float | str = REFRESH_DAMPING,
                    base: str | os.PathLike | None = None) -> ServerApp:
    """A ServerApp running :func:`run_round` (``method_settings``: the fusion method's settings;
    ``refresh``: add the refresh round, its centre step damped by ``refresh_damping``; ``base``: the server's copy
    of the base, sent once to every node)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_round(grid, settings, out_dir, method, options, val_path, on_bad_reply, min_nodes,
                      method_settings=method_settings, refresh=refresh, refresh_damping=refresh_damping, base=base)
        except PfuseError as exc:
            print(f"error: {exc}")
            raise

    return app
