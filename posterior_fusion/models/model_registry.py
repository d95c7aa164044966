"""The model registry: the built-in builders (:mod:`.builtin`) and those that *installed* packages register under
the entry-point group ``posterior_fusion.models`` (name = model name, value = ``module:builder``; the builder's
annotated keyword arguments of type int, float, bool, str or list[int] are the spec's allowed kwargs). A built-in
name cannot be shadowed; an unknown name is refused, naming the package an artifact says provided it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib.metadata import entry_points

from torch import nn

from posterior_fusion.errors import ModelSpecError, shown
from posterior_fusion.models import builtin

# name -> (builder, {kwarg: type}); the types are what a JSON spec may carry.
MODEL_REGISTRY: dict[str, tuple[Callable[..., nn.Module], dict[str, type]]] = {
    "lenet": (builtin.lenet, {"num_classes": int, "in_channels": int, "bias": bool, "width": int}),
    "cnn": (builtin.cnn, {"num_classes": int, "in_channels": int, "bias": bool}),
    "mlp": (builtin.mlp, {"num_classes": int, "in_features": int, "hidden": int, "bias": bool, "hidden_sizes": list}),
    "resnet20": (builtin.resnet20, {"num_classes": int, "in_channels": int, "width": int, "norm": str}),
    "transformer": (builtin.transformer, {"num_classes": int, "in_channels": int, "row_size": int, "width": int,
                                          "layers": int, "heads": int}),
}
ENTRY_POINT_GROUP = "posterior_fusion.models"


_ALLOWED_TYPES = {int: int, float: float, bool: bool, str: str, "int": int, "float": float, "bool": bool, "str": str,
                  "list[int]": list, "list[int] | None": list}


def _plugin_types(builder: Callable) -> dict[str, type]:
    out = {}
    for name, p in inspect.signature(builder).parameters.items():
        ann = p.annotation
        if ann in _ALLOWED_TYPES:
            out[name] = _ALLOWED_TYPES[ann]
        elif p.default is not inspect.Parameter.empty and type(p.default) in (int, float, bool, str):
            out[name] = type(p.default)
    return out


def plugin_models() -> dict[str, tuple[Callable[..., nn.Module], dict[str, type], str]]:
    """Installed plugins: name -> (builder, kwarg types, "package==version")."""
    found = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in MODEL_REGISTRY:
            continue  # built-in names cannot be shadowed
        try:
            builder = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the CLI
            found[ep.name] = (None, {}, f"{getattr(ep.dist, 'name', '?')} (failed to load: {exc})")
            continue
        dist = ep.dist
        found[ep.name] = (builder, _plugin_types(builder), f"{dist.name}=={dist.version}" if dist else "unknown")
    return found


def resolve_model(name: str, provider: str | None = None) -> tuple[Callable[..., nn.Module], dict[str, type], str | None]:
    """(builder, kwarg types, provider) of ``name``: a built-in, or an installed plugin."""
    if name in MODEL_REGISTRY:
        return (*MODEL_REGISTRY[name], None)
    plugins = plugin_models()
    if name in plugins and plugins[name][0] is not None:
        return plugins[name]
    hint = f" (the artifact says it comes from {shown(provider)}: install that package)" if provider else ""
    if name in plugins:
        hint = f" (its plugin {shown(plugins[name][2])})"
    known = sorted(MODEL_REGISTRY) + sorted(k for k, v in plugins.items() if v[0] is not None)
    raise ModelSpecError(f"unknown model {shown(name)}{hint}; known: {', '.join(known)}")
