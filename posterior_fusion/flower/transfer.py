"""Files in Flower messages, of any size: a file's bytes travel as a one-dimensional ``uint8``
:class:`flwr.app.Array` in the message's ``files`` ArrayRecord, which Flower sends as content-addressed chunks
(``ArrayChunk``, each named by the SHA-256 of its bytes and checked by the object store on arrival; 5 MiB each
by default), so no single gRPC message carries more than one chunk whatever the file's size and the transport's
message limit (``GRPC_MAX_MESSAGE_LENGTH`` on the SuperLink). The whole file's SHA-256 and length travel
beside it in the message's ConfigRecord and are checked on arrival: a reply whose chunks were lost, reordered
or changed is refused in one line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

FILES = "files"  # the ArrayRecord holding a message's files


def file_fields(name: str, blob: bytes) -> dict[str, str | int]:
    """The ConfigRecord fields that describe file ``name`` of a message: ``<name>-sha256``, ``<name>-bytes``."""
    return {f"{name}-sha256": hashlib.sha256(blob).hexdigest(), f"{name}-bytes": len(blob)}


def files_record(files: Mapping[str, bytes]) -> ArrayRecord:
    """The ``files`` ArrayRecord of a message: each file's bytes as a uint8 array (shape ``(len(bytes),)``)."""
    return ArrayRecord({name: Array(np.frombuffer(blob, dtype=np.uint8)) for name, blob in files.items()})


def message_content(config_name: str, config: dict, files: Mapping[str, bytes]) -> RecordDict:
    """A message's content: ``config`` (plus each file's SHA-256 and length) as the ConfigRecord
    ``config_name``, the files' bytes in the ``files`` ArrayRecord."""
    fields = dict(config)
    for name, blob in files.items():
        fields.update(file_fields(name, blob))
    content = {config_name: ConfigRecord(fields)}
    if files:
        content[FILES] = files_record(files)
    return RecordDict(content)


class TransferError(ValueError):
    """A file of a message is missing, malformed, over the size allowed, or not the bytes its SHA-256 names."""


def received_file(content: RecordDict, config: Mapping, name: str, max_bytes: int | None = None) -> bytes | None:
    """The bytes of file ``name`` of a received message (None when the message carries no such file), after
    checking its length and SHA-256 against the ConfigRecord fields ``config`` (:func:`file_fields`).
    ``max_bytes``: the largest file accepted (checked from the declared and the array's length before any
    bytes are copied). Raises :class:`TransferError`."""
    sha, size = config.get(f"{name}-sha256"), config.get(f"{name}-bytes")
    records = content.array_records
    arr = records[FILES].get(name) if FILES in records else None
    if sha is None and arr is None:
        return None
    if not isinstance(sha, str) or isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TransferError(f"file '{name}' comes without its '{name}-sha256' and '{name}-bytes'")
    if arr is None:
        raise TransferError(f"file '{name}' is announced ({size} bytes) but its bytes are missing")
    if arr.stype != "numpy.ndarray" or arr.dtype != "uint8" or tuple(arr.shape) != (size,):
        raise TransferError(f"file '{name}' must be {size} bytes as a uint8 array, got {arr.dtype} of shape "
                            f"{tuple(arr.shape)}")
    if max_bytes is not None and size > max_bytes:
        raise TransferError(f"file '{name}' is {size} bytes, more than the {max_bytes} allowed")
    blob = arr.numpy().tobytes()
    if len(blob) != size or hashlib.sha256(blob).hexdigest() != sha:
        raise TransferError(f"file '{name}' is not the bytes its SHA-256 names (a chunk was lost or changed on "
                            "the way)")
    return blob
