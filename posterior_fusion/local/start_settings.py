"""Where a silo's M models start, declared once and free of torch: ``pfuse init`` and ``pfuse fit-local`` take these
as options, a Flower server sends them to every node (:class:`~posterior_fusion.flower.federated_settings.FederatedSettings`),
and each has one default here."""

from __future__ import annotations

from dataclasses import dataclass

from posterior_fusion import ranges
from posterior_fusion.settings import setting


@dataclass(frozen=True)
class StartSettings:
    """The model and the shared starting points of every silo's components."""

    model: str = setting("lenet", "Model architecture: a built-in (lenet, cnn, mlp, resnet20) or one registered by an "
                                  "installed package under the 'posterior_fusion.models' entry points.")
    model_kwargs: dict = setting({}, "JSON keyword arguments of the model, e.g. {\"bias\": true}.")
    components: int = setting(5, "Mixture components M: one shared starting point each.", bounds=ranges.COMPONENTS)
    init_seed: int = setting(0, "Seed of the shared starting points.", bounds=ranges.SEED)
