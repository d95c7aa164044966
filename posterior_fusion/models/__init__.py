"""Models: a JSON spec (:mod:`.spec`) rebuilt through the registry of built-in and installed builders
(:mod:`.model_registry`); nothing is ever unpickled. The layers, their functional forms and the members' modules live in
the other modules of this package."""

from posterior_fusion.models.model_registry import ENTRY_POINT_GROUP, MODEL_REGISTRY, plugin_models, resolve_model
from posterior_fusion.models.spec import (
    MAX_PARAMETERS,
    MAX_SPEC_INT,
    TRAINING_BYTES_PER_PARAMETER,
    ModelSpec,
    non_parameter_state,
)

__all__ = ["ENTRY_POINT_GROUP", "MAX_PARAMETERS", "MAX_SPEC_INT", "MODEL_REGISTRY", "TRAINING_BYTES_PER_PARAMETER",
           "ModelSpec", "non_parameter_state", "plugin_models", "resolve_model"]
