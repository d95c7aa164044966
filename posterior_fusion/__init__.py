"""posterior-fusion: one-shot federated learning by Bayesian posterior fusion.

``posterior_fusion.load(path)`` validates an artifact and returns typed objects.
"""

from posterior_fusion.artifact import ClientPosterior, Component, GlobalEnsemble, load
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron, Precision
from posterior_fusion.errors import PfuseError
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec

__version__ = "0.1.0"
__all__ = ["load", "ClientPosterior", "Component", "GlobalEnsemble", "Precision", "Diag", "Dense",
           "Kron", "BlockDiag", "PfuseError", "ParameterLayout", "ModelSpec", "__version__"]
