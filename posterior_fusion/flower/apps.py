"""Module-level apps for ``flwr run`` (components named in examples/flower/pyproject.toml).

Run config keys (names as on the CLI):
- fit settings sent to every node: model, model-kwargs, components, init-seed, structure,
  temperature, prior-var, epochs, batch-size, lr, momentum, swag, swag-rank, ggn, train-seed, and
  base-sha256 (fine-tune a shared base: each node's own copy, node config ``base``, checked by hash);
- the round: silo-dir, out-dir, val, on-bad-reply, min-nodes, round-timeout, max-memory;
- the refresh round (``pfuse recapture --at`` on every node, then fuse again): refresh (bool),
  refresh-damping (``recapture --damping``);
- the fusion: method, robust, fuse-temperature, fuse-prior-var, batchnorm-statistics (``fuse
  --batchnorm-statistics``: reset estimates the statistics on ``val``'s inputs), and every setting of the method
  as ``set.<name>`` (a TOML table ``[tool.flwr.app.config.set]``), e.g. ``set.steps = 300``.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from posterior_fusion.flower.federation import FederatedSettings, make_client_app, run_round
from posterior_fusion.fusion import FusionOptions
from posterior_fusion.fusion.registry import resolve_default
from posterior_fusion.local.recapture import REFRESH_DAMPING

clientapp = make_client_app()
serverapp = ServerApp()


def fusion_from_run_config(cfg: dict[str, Any]) -> tuple[str, FusionOptions, dict[str, Any], bool]:
    """(method, shared options, the method's settings, robust) from a flat Flower run config."""
    settings = {k[len("set."):]: v for k, v in cfg.items() if k.startswith("set.")}
    options = FusionOptions(temperature=cfg.get("fuse-temperature"), prior_var=cfg.get("fuse-prior-var"), progress=False,
                            batchnorm_statistics=str(cfg.get("batchnorm-statistics", "fold")))
    method, settings = resolve_default(str(cfg["method"]) if "method" in cfg else None, settings)
    return method, options, settings, bool(cfg.get("robust", False))


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    cfg = dict(context.run_config)
    method, options, settings, robust = fusion_from_run_config(cfg)
    run_round(grid, FederatedSettings.from_run_config(cfg), str(cfg.get("out-dir", "flower-run")),
              method=method, options=options, val_path=str(cfg["val"]) if cfg.get("val") else None,
              on_bad_reply=str(cfg.get("on-bad-reply", "skip")), min_nodes=int(cfg.get("min-nodes", 1)),
              method_settings=settings, max_memory=cfg.get("max-memory"), robust=robust,
              round_timeout=cfg.get("round-timeout", 0.0), refresh=bool(cfg.get("refresh", False)),
              refresh_damping=cfg.get("refresh-damping", REFRESH_DAMPING))
