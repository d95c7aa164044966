"""Typed errors. Every failure a user can cause maps to one of these.

The CLI catches :class:`PfuseError` and prints ``error: <message>`` on one line with a
non-zero exit code; the Python API lets them propagate. Messages name settings as the library
spells them, in backticks (`` `min_size` ``); the CLI shows each as its flag (``--min-size``).
"""

from __future__ import annotations


class PfuseError(Exception):
    """Base class of every error posterior-fusion raises on bad input."""

    exit_code = 2


class ArtifactError(PfuseError):
    """A problem with one artifact file; ``file`` and ``hdf5_path`` say where."""

    def __init__(self, file: str, message: str, hdf5_path: str | None = None) -> None:
        self.file = str(file)
        self.hdf5_path = hdf5_path
        self.reason = message
        where = f"{self.file}" + (f" [{hdf5_path}]" if hdf5_path else "")
        super().__init__(f"{where}: {message}")


class ArtifactNotFoundError(ArtifactError):
    """The file does not exist or cannot be opened for reading."""


class NotAnArtifactError(ArtifactError):
    """The file is not HDF5, is truncated, or is not a posterior-fusion file."""


class UnsupportedVersionError(ArtifactError):
    """The file's ``format_version`` is not one this reader knows."""


class SchemaError(ArtifactError):
    """A path, link, dtype or shape breaks the schema (checked before any data is read)."""


class ValueCheckError(ArtifactError):
    """Data read from the file is invalid (NaN/Inf, negative curvature, asymmetric factor)."""


class DataError(PfuseError):
    """A silo/test data file is invalid (bad labels, shapes, missing fields)."""


class ModelSpecError(PfuseError):
    """A model spec names an unknown model or carries unexpected arguments."""


class IncompatibleArtifactsError(PfuseError):
    """A set of artifacts cannot be fused together (different model, layout, M, ...)."""


class MethodNotApplicableError(PfuseError):
    """A fusion method cannot run on the given curvature structure or inputs."""


class ConfigError(PfuseError):
    """A command-line, config-file or API option has an invalid value (configuration only)."""


class CaptureNotApplicableError(ConfigError):
    """The chosen curvature capture cannot take this model (its layers): the model or the option must change."""


class ResumeError(PfuseError):
    """A partial run cannot be resumed (it was made with other settings, data or inits)."""


class ScreeningError(PfuseError):
    """Robust screening left nothing to fuse."""


class FederationError(PfuseError):
    """A federated round cannot go on (too few nodes, no valid reply, a bad reply under 'fail')."""


class OutputError(PfuseError):
    """An output cannot be written (location not writable, disk full, locked by another writer)."""


class ResourceLimitError(PfuseError):
    """The requested work would not fit in the allowed memory (estimated before allocating)."""


def shown(value: object, limit: int = 200) -> str:
    """A string that came from a file, made safe to print: ``repr``-escaped (no newline, no
    terminal escape code can act) and cut to ``limit`` characters."""
    text = repr(str(value))
    return text if len(text) <= limit else text[: limit - 4] + "...'"


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0, 9), *range(11, 32), 127, *range(128, 160)]}


def terminal_safe(text: str, limit: int | None = None) -> str:
    """``text`` with every control character except newline and tab escaped (so nothing read
    from a file can move the cursor, clear the screen or recolour it), cut to ``limit``."""
    out = str(text).translate(_CONTROL)
    if limit is not None and len(out) > limit:
        out = out[:limit] + f"... ({len(out) - limit} more characters)"
    return out


class NonFiniteOutputError(PfuseError):
    """A run produced NaN or Inf where a file would store it; nothing is written."""


class IndefinitePrecisionError(PfuseError):
    """A precision the server must factor is not positive definite in float64 (curvature far out of scale
    between clients, or a prior weaker than the curvature's float32 rounding); nothing is written."""
