"""HDF5 artifacts: schema, atomic writer, validating reader, typed objects."""

from posterior_fusion.artifact.objects import ClientPosterior, Component, GlobalEnsemble, SwagMoments, build_model
from posterior_fusion.artifact.reader import file_sha256, load, load_client, load_global
from posterior_fusion.artifact.writer import write_client_artifact, write_global_artifact

__all__ = ["ClientPosterior", "Component", "GlobalEnsemble", "SwagMoments", "build_model", "load",
           "load_client", "load_global", "write_client_artifact", "write_global_artifact", "file_sha256"]
