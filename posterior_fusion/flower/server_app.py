"""The ServerApp: the shared settings sent to every node, each reply validated with the same reader as files
(a bad or missing reply left out or the run stopped, per ``on_bad_reply``), the fusion, and the refresh round
(:mod:`posterior_fusion.flower`)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from posterior_fusion import budget
from posterior_fusion.artifact import load_client
from posterior_fusion.errors import (
    ArtifactError,
    ConfigError,
    FederationError,
    IncompatibleArtifactsError,
    PfuseError,
    ResourceLimitError,
)
from posterior_fusion.files import check_output, write_atomically
from posterior_fusion.flower.federated_settings import FederatedSettings
from posterior_fusion.flower.pretrained_base import base_to_send
from posterior_fusion.flower.round_settings import OnBadReply
from posterior_fusion.flower.transfer import TransferError, message_content, received_file
from posterior_fusion.fusion import FusionOptions, fuse, write_fused
from posterior_fusion.fusion.distill import DistillConfig
from posterior_fusion.fusion.distill_settings import TeachingConfig
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.local.refresh_settings import REFRESH_DAMPING, check_damping


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


def reply_from_message(key: int, msg: Message, max_memory: int | str | None = None) -> Reply:
    """Type-check a reply's fields and take its artifact file (:func:`~posterior_fusion.flower.transfer.received_file`:
    its length and SHA-256 checked, at most a third of the memory budget); anything unexpected becomes an error reply
    (never an exception)."""
    node = msg.metadata.src_node_id
    if msg.has_error():
        return Reply(key, None, f"node error: {str(msg.error.reason)[:200]}", node)
    try:
        rec = msg.content["artifact"]
        pid = rec["partition-id"] if "partition-id" in rec else None
        limit = budget.resolve_limit(max_memory)
        blob = received_file(msg.content, rec, "artifact", None if limit is None else limit // 3)
    except TransferError as exc:
        return Reply(key, None, str(exc), node)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return Reply(key, None, f"reply has no valid 'artifact' record ({type(exc).__name__})", node)
    if blob is None:
        return Reply(key, None, "reply carries no file 'artifact'", node)
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
    if on_bad_reply not in OnBadReply.values():
        raise ConfigError(f"on_bad_reply must be one of {', '.join(OnBadReply.values())}")
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
              base: str | os.PathLike | None = None, unlabeled_path: str | os.PathLike | None = None,
              distill: DistillConfig | TeachingConfig | None = None) -> dict:
    """Server side of the round: send settings, collect artifacts, fuse, write ``global.h5``.

    Client files are named by the server (``client_<k>.h5``, k = the node's index in sorted
    node-id order), never from reply content; a file whose node reported a partition id no other
    node reported also gets the name ``silo_<id>.h5`` (a hard link: :func:`name_by_silo`). ``round_timeout``: seconds to wait for replies
    (0 = until every node answered or Flower reported it unavailable). The global artifact's
    metadata ``federation.left_out`` records every node left out and why. ``refresh``: a second,
    training-free exchange (module docstring) and ``global_refreshed.h5``; its metadata
    ``federation.refresh`` records the nodes, bytes moved and who was left out. ``base``: the server's copy of
    the base the run fine-tunes, checked and sent once in every train message
    (:func:`~posterior_fusion.flower.pretrained_base.base_to_send`; a node with its own copy uses that).
    ``distill``: after the collection the fused predictive teaches one network on ``unlabeled_path`` (or on inputs
    synthesised from the artifacts), as ``fuse --distill`` does on files, and ``global.h5`` serves it; an
    interrupted teaching resumes from ``global.h5.distill-partial`` when the round is run again."""
    if on_bad_reply not in OnBadReply.values():
        raise ConfigError(f"on-bad-reply must be one of {', '.join(OnBadReply.values())}, got {on_bad_reply!r}")
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
    content = message_content("config", {"settings": settings.to_json()}, {"base": sent} if sent is not None else {})
    messages = [Message(content, dst_node_id=i, message_type="train") for i in ids]
    log(f"sent settings{' and the base' if sent is not None else ''} to {len(messages)} nodes")
    answers, missing = exchange(grid, messages, list(range(len(ids))), float(round_timeout), log)
    if missing:
        if on_bad_reply == "fail":
            raise FederationError(f"{len(missing)} node(s) did not reply: "
                                  + "; ".join(f"node {ids[k]}: {why}" for k, why in sorted(missing.items())))
        log(f"{len(missing)} node(s) did not reply; continuing without them")
    replies = [reply_from_message(k, m, max_memory) for k, m in sorted(answers.items())]
    paths = collect_replies(replies, out, on_bad_reply, log, max_memory, settings.base_sha256)
    silo_files = name_by_silo(replies, paths, out, log)
    inputs, result, meta = fuse(paths, method, options or FusionOptions(progress=False), method_settings,
                                val_path, unlabeled_path, log=log, max_memory=max_memory, robust=robust, distill=distill,
                                distill_checkpoint=out / "global.h5.distill-partial" if distill is not None else None)
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
    messages = [Message(message_content("refresh", {"damping": damping, "own-sha256": hashlib.sha256(p.read_bytes())
                                                    .hexdigest()}, {"global": at}),
                        dst_node_id=ids[k], message_type="query") for k, p in zip(keys, paths)]
    log(f"refresh round: sent the global artifact to {len(messages)} nodes")
    answers, missing = exchange(grid, messages, keys, round_timeout, log)
    if missing and on_bad_reply == "fail":
        raise FederationError(f"{len(missing)} node(s) did not answer the refresh round: "
                              + "; ".join(f"node {ids[k]}: {why}" for k, why in sorted(missing.items())))
    replies = [reply_from_message(k, m, max_memory) for k, m in sorted(answers.items())]
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
