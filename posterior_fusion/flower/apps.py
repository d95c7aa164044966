"""Module-level apps for ``flwr run`` (components named in examples/flower/pyproject.toml).

Run config keys: model, model-kwargs, mixtures, init-seed, structure, temperature, prior-var,
epochs, batch-size, lr, momentum, swag, ggn, seed (the fit settings); silo-dir, out-dir,
method, val, on-bad-reply, min-nodes (the round).
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from posterior_fusion.flower.federation import FederatedSettings, make_client_app, run_round
from posterior_fusion.fusion import FusionOptions

clientapp = make_client_app()
serverapp = ServerApp()


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    cfg = dict(context.run_config)
    run_round(grid, FederatedSettings.from_run_config(cfg), str(cfg.get("out-dir", "flower-run")),
              method=str(cfg.get("method", "fedbens")), options=FusionOptions(progress=False),
              val_path=str(cfg["val"]) if cfg.get("val") else None,
              on_bad_reply=str(cfg.get("on-bad-reply", "skip")), min_nodes=int(cfg.get("min-nodes", 1)))
