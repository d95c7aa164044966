"""Fusion methods (one module each, registered in :mod:`.registry`) and the server entry points.

``fuse(paths, method, options, settings)`` works on files; ``fuse_clients`` on loaded
posteriors. Shared options are :class:`FusionOptions`; each method's own hyper-parameters
are its settings record (``METHODS[name].settings``).
"""

from posterior_fusion.fusion.from_files import fuse
from posterior_fusion.fusion.from_posteriors import applicable_settings, fuse_clients, method_settings, write_fused
from posterior_fusion.fusion.registry import METHODS, get_method
from posterior_fusion.fusion.types import FusionInputs, FusionMethod, FusionOptions, FusionResult

__all__ = ["FusionInputs", "FusionMethod", "FusionOptions", "FusionResult", "METHODS", "get_method", "fuse",
           "fuse_clients", "method_settings", "applicable_settings", "write_fused"]
