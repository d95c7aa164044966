"""Config-driven experiment grids (``pfuse experiment CONFIG.toml``): :mod:`.config` (the
grid), :mod:`.grid` (cached levels: partition -> fits -> fusion results), :mod:`.report`
(tables and plots)."""

from posterior_fusion.experiment.grid import run_experiment
from posterior_fusion.experiment.grid_config import ExperimentConfig
from posterior_fusion.experiment.report import aggregate, write_tables

__all__ = ["ExperimentConfig", "run_experiment", "aggregate", "write_tables"]
