"""The pretrained base of a fine-tuning run, by hash: the server's copy sent once, each node's copy checked.

A run that fine-tunes a shared base names it by its SHA-256 (run config ``base-sha256``). A node trains from its
own copy when it holds one (node config ``base``: a silo that pins its base never depends on the server's bytes),
else from the copy the server sent once in its train message (run config ``base``: the server's file). Either copy
is refused in one line unless its SHA-256 is the run's; a sent copy is kept in the node's state folder as
``base-<sha256>.safetensors`` (or ``.h5``, a fused global artifact used as the base) and read with the same checks
as ``pfuse init --base``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from posterior_fusion.errors import ConfigError, FederationError, IncompatibleArtifactsError
from posterior_fusion.files import write_atomically
from posterior_fusion.local.init import read_base
from posterior_fusion.models import ModelSpec

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def base_to_send(spec: ModelSpec, base_sha256: str | None, base: str | os.PathLike | None,
                 max_memory: int | str | None = None) -> tuple[bytes, ModelSpec, torch.Tensor] | None:
    """The server's copy of the base, read once: ``(the bytes every node's train message carries, then what
    :func:`~posterior_fusion.local.init.read_base` returns for it: the spec holding the base's statistics, the
    weights (d,))``, after the checks a node makes — the bytes' SHA-256 is the run's ``base_sha256``, the file
    fits ``spec``. None: ``base`` unset."""
    if base is None:
        return None
    if not base_sha256:
        raise ConfigError(f"run config `base` names {base}, but the run fine-tunes no base: set `base-sha256` to "
                          "its SHA-256")
    blob = Path(base).read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    if sha != base_sha256:
        raise IncompatibleArtifactsError(f"{base}: SHA-256 {sha[:12]}… is not the run's base {base_sha256[:12]}…")
    held, weights, _ = read_base(spec, base, max_memory)
    return blob, held, weights


def node_base(own: str | None, base_sha256: str | None, sent: object, state: Path) -> Path | None:
    """The base file this node fine-tunes: its own copy ``own`` (node config ``base``) when it names one, else the
    server's ``sent`` bytes checked against the run's ``base_sha256`` and kept as ``state/base-<sha256>.*``;
    None when the run fine-tunes no base or neither copy exists (the fit then refuses in one line)."""
    if not base_sha256:
        return None
    if own:
        return Path(own)
    if sent is None:
        return None
    if not isinstance(sent, bytes):
        raise FederationError(f"the train message's 'base' must be the bytes of the base file, got "
                              f"{type(sent).__name__}")
    sha = hashlib.sha256(sent).hexdigest()
    if sha != base_sha256:
        raise FederationError(f"the base the server sent has SHA-256 {sha[:12]}…, not the run's base "
                              f"{base_sha256[:12]}…")
    path = state / f"base-{sha}{'.h5' if sent.startswith(HDF5_SIGNATURE) else '.safetensors'}"
    if not path.is_file():
        state.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda tmp: tmp.write_bytes(sent))
    return path
