"""The ClientApp: a node fits its own silo (the same :func:`~posterior_fusion.local.fit.fit_local` as
``pfuse fit-local``) and replies with the artifact's bytes; in the refresh round it recaptures its own kept
artifact at the global (:mod:`posterior_fusion.flower`)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from posterior_fusion.compat import RENAMED_FIT_SETTINGS, rename_keys
from posterior_fusion.errors import (
    ConfigError,
    FederationError,
)
from posterior_fusion.files import own_private_folder, user_data_folder, write_atomically
from posterior_fusion.flower.federated_settings import FederatedSettings
from posterior_fusion.flower.pretrained_base import node_base
from posterior_fusion.flower.round_settings import NodeSettings, RoundSettings
from posterior_fusion.flower.secure import is_secure_fit, secure_fit_reply, secure_sums_mod
from posterior_fusion.flower.transfer import FILES, TransferError, message_content, received_file
from posterior_fusion.local.fit import Start, fit_local
from posterior_fusion.local.fit_config import LocalModelConfig, fit_settings
from posterior_fusion.local.refresh import check_damping, refresh_to_file
from posterior_fusion.local.refresh_settings import refresh_privacy_from
from posterior_fusion.models import ModelSpec
from posterior_fusion.settings import convert


def fit_to_artifact(settings: FederatedSettings, silo_path: str | os.PathLike, out: str | os.PathLike,
                    log: Callable[[str], None] = lambda m: None, local_model: LocalModelConfig | None = None,
                    base: str | os.PathLike | None = None) -> None:
    """The work of one silo: exactly what ``pfuse fit-local --init-seed S`` does (``local_model``:
    the node's own architecture, HBFL's heterogeneous client — chosen by the node, not the server), or,
    when the run names a base by its SHA-256, what ``pfuse init --base BASE`` + ``fit-local --init`` do with
    the node's own copy ``base`` (node config ``base``), refused in one line unless its SHA-256 is the run's."""
    cfg = settings.fit_config()
    if local_model is not None:
        cfg = replace(cfg, local_model=local_model)
        cfg.validate()
    if settings.base_sha256 and base is None:
        raise ConfigError(f"the run fine-tunes the base {settings.base_sha256[:12]}…: set this node's node config "
                          "'base' to its copy of the base file, or the server's run config 'base' to send it")
    start = Start(settings.init_seed, settings.components, base=base if settings.base_sha256 else None,
                  base_sha256=settings.base_sha256)
    fit_local(settings.spec(), silo_path, start, cfg, out, log=log)


def node_local_model(context: Context) -> LocalModelConfig | None:
    """The node's own architecture from its node config (``local-model``, ``local-model-kwargs``,
    ``local-model-epochs``, ``local-model-weight``: the fit settings of :class:`LocalModelConfig`), or None."""
    nc = rename_keys(dict(context.node_config), {old.replace("_", "-"): new.replace("_", "-")
                                                 for old, (new, _) in RENAMED_FIT_SETTINGS.items()},
                     "node config", print)
    if "local-model" not in nc:
        return None
    values = {s.path[-1]: convert(nc[key], s.type, key, "node config")
              for s in fit_settings() if s.path[0] == "local_model" and (key := s.name.replace("_", "-")) in nc}
    local = LocalModelConfig(**values)
    spec = ModelSpec(str(local.model), local.model_kwargs)  # a registered model with the arguments it takes
    local = replace(local, model=spec.name, model_kwargs=dict(spec.kwargs))
    local.validate()
    return local


def node_settings(context: Context) -> NodeSettings:
    """The node's own settings from its node config (:class:`~posterior_fusion.flower.round_settings.NodeSettings`)."""
    return NodeSettings.from_node_config(dict(context.node_config))


def node_silo(context: Context, silo_dir: str | os.PathLike | None = None) -> Path:
    node = node_settings(context)
    if node.silo is not None:
        return Path(node.silo)
    folder = silo_dir if silo_dir is not None else RoundSettings.from_run_config(dict(context.run_config)).silo_dir
    if node.partition_id is not None and folder is not None:
        return Path(str(folder)) / f"client_{node.partition_id}.h5"
    raise ConfigError("this node has no silo: set node_config 'silo', or a silo-dir with partition-id")


def node_state_dir(context: Context, silo: Path) -> Path:
    """Where the node keeps its own artifacts between rounds, a folder of this user's only (0700, never through
    a link: :func:`~posterior_fusion.files.own_private_folder`): node config ``state-dir``, else
    ``<the user's data folder>/posterior-fusion/node/<hash of the silo's path>``."""
    state_dir = node_settings(context).state_dir
    if state_dir is not None:
        return own_private_folder(Path(state_dir), "node config state-dir")
    key = hashlib.sha256(str(silo.resolve()).encode()).hexdigest()[:16]
    return own_private_folder(user_data_folder() / "posterior-fusion" / "node" / key, "the node's state folder")


def client_train(msg: Message, context: Context, silo_dir: str | os.PathLike | None = None) -> Message:
    """ClientApp train handler: fit the node's silo (from the run's base, when it fine-tunes one: the node's own
    copy or the one the message carries, :func:`~posterior_fusion.flower.pretrained_base.node_base`), keep the artifact in the
    node's state folder (named by its SHA-256, for the refresh round) and reply with its bytes — or, in the secure aggregation's
    round, with the fusion method's statistics only (:func:`~posterior_fusion.flower.secure.secure_fit_reply`)."""
    secure = is_secure_fit(msg)
    config = msg.content.config_records["fitins.config" if secure else "config"]
    settings = FederatedSettings.from_json(str(config["settings"]))
    silo = node_silo(context, silo_dir)
    state = node_state_dir(context, silo)
    try:  # the plain round sends the base as a file; SecAgg+'s legacy round as bytes in its config
        sent = config.get("base") if secure else received_file(msg.content, config, "base")
    except TransferError as exc:
        raise FederationError(f"the train message: {exc}") from None
    base = node_base(node_settings(context).base, settings.base_sha256, sent, state)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "client.h5"
        fit_to_artifact(settings, silo, out, local_model=node_local_model(context), base=base)
        blob = out.read_bytes()
    own = state / f"{hashlib.sha256(blob).hexdigest()}.h5"

    def write_private(tmp_path: Path) -> None:  # readable by this user only
        fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out_file:
            out_file.write(blob)

    write_atomically(own, write_private)
    if secure:  # only the method's statistics leave, masked by SecAgg+ (flower/secure.py)
        return secure_fit_reply(msg, own)
    return artifact_reply(msg, context, silo, blob)


def artifact_reply(msg: Message, context: Context, silo: Path, blob: bytes) -> Message:
    """The reply carrying an artifact: its bytes as the file ``artifact`` (:mod:`~posterior_fusion.flower.transfer`:
    chunked by Flower, whatever its size), the silo's path and the node's partition id in the ``artifact`` record."""
    reply: dict = {"silo": str(silo)}
    partition = node_settings(context).partition_id
    if partition is not None:
        reply["partition-id"] = partition
    return Message(message_content("artifact", reply, {"artifact": blob}), reply_to=msg)


def client_refresh(msg: Message, context: Context, silo_dir: str | os.PathLike | None = None) -> Message:
    """ClientApp query handler, the refresh round: recapture the node's own artifact at the global
    artifact's members on its silo, reply with the refreshed artifact's bytes (as ``train`` does)."""
    rec = msg.content["refresh"]
    sent = set(msg.content.array_records[FILES].keys()) if FILES in msg.content.array_records else set()
    if "artifact" in rec or sent - {"global"}:
        raise FederationError("a refresh message may name the node's own artifact by 'own-sha256', never send "
                              "one: the node recaptures only its own copy")
    own, damping = rec.get("own-sha256"), rec.get("damping")
    if not isinstance(own, str) or len(own) != 64 or any(ch not in "0123456789abcdef" for ch in own):
        raise FederationError("a refresh message needs 'own-sha256', the SHA-256 of the node's own artifact")
    try:
        at = received_file(msg.content, rec, "global")
    except TransferError as exc:
        raise FederationError(f"the refresh message: {exc}") from None
    if at is None:
        raise FederationError("a refresh message needs the file 'global', the global artifact")
    if damping != "auto" and (isinstance(damping, bool) or not isinstance(damping, (int, float))):
        raise FederationError(f"a refresh message's 'damping' must be 'auto' or a number, got {type(damping).__name__}")
    damping = check_damping(damping, "the refresh message's damping")
    radius = node_settings(context).refresh_trust_radius
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
        refresh_to_file(first, silo, glob, out, damping=damping, log=lambda m: None,
                          trust_radius=float(radius), privacy=privacy)
        blob = out.read_bytes()
    return artifact_reply(msg, context, silo, blob)


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
