"""What the server sends to every node: the model, M, the init seed and every fit setting (:class:`FederatedSettings`),
and the round's policies."""

from __future__ import annotations

import json
from typing import Any

from posterior_fusion import ranges
from posterior_fusion.compat import RENAMED_RUN_CONFIG_KEYS, rename_keys
from posterior_fusion.errors import (
    ConfigError,
)
from posterior_fusion.local.fit_config import (
    FitConfig,
    fit_config_from,
    fit_settings,
)
from posterior_fusion.local.start_settings import StartSettings
from posterior_fusion.models import ModelSpec
from posterior_fusion.settings import check_declared, convert


class FederatedSettings:
    """What the server sends to every node: where the models start (:class:`~posterior_fusion.local.start_settings.
    StartSettings`: the model, M, the init seed; ``None``: its declared default), the pretrained base's SHA-256, and
    every fit setting of ``pfuse fit-local`` (:func:`~posterior_fusion.local.fit_config.fit_settings`, declared
    once: a setting added there is a run-config key here too), except the local model, which each node chooses in
    its own node config. A fit setting reads as an attribute (``settings.epochs``)."""

    def __init__(self, model: str | None = None, model_kwargs: dict | None = None, components: int | None = None,
                 init_seed: int | None = None, base_sha256: str | None = None, **fit: Any) -> None:
        table = _server_fit_settings()
        unknown = sorted(set(fit) - set(table))
        if unknown:
            raise ConfigError(f"no fit setting {', '.join(map(repr, unknown))}; the fit settings: {', '.join(table)}")
        for name, value in (("components", components), ("init-seed", init_seed)):
            if value is not None and not ranges.is_int(value):  # the server's values, exactly integers
                raise ConfigError(f"federated settings: {name} must be an integer, got {str(value)[:40]!r}")
        if not isinstance(model, (str, type(None))) or not isinstance(model_kwargs, (dict, type(None))):
            raise ConfigError("federated settings: model must be a name and model-kwargs an object")
        given = {"model": model, "model_kwargs": model_kwargs, "components": components, "init_seed": init_seed}
        start = StartSettings(**{k: v for k, v in given.items() if v is not None})
        check_declared(start, "federated settings", dashed=True)  # named as the run config spells them
        self.model, self.model_kwargs = start.model, dict(start.model_kwargs)
        self.components, self.init_seed = start.components, start.init_seed
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
        if "model-kwargs" in cfg:
            cfg = {**cfg, "model-kwargs": convert(cfg["model-kwargs"], dict, "model-kwargs", "run config")}
        keys = {"model": "model", "model-kwargs": "model_kwargs", "components": "components", "init-seed": "init_seed",
                "base-sha256": "base_sha256", **{s.run_config_key: name for name, s in _server_fit_settings().items()}}
        return cls(**{name: cfg[key] for key, name in keys.items() if key in cfg})

    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, dict(self.model_kwargs))

    def fit_config(self) -> FitConfig:
        return fit_config_from(self.fit, "federated settings: ")


def _server_fit_settings() -> dict:
    return {s.name: s for s in fit_settings() if s.path[0] != "local_model"}
