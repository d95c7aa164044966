"""Module-level apps for ``flwr run`` (components named in examples/flower/pyproject.toml).

Run config keys (names as on the CLI):
- fit settings sent to every node: model, model-kwargs, components, init-seed, structure,
  temperature, prior-var, epochs, batch-size, lr, momentum, swag, swag-rank, ggn, train-seed, and
  base-sha256 (fine-tune a shared base, checked by hash: each node's own copy, node config ``base``, or the
  server's, run config ``base``, sent once in every train message: :mod:`posterior_fusion.flower.pretrained_base`);
- the round (declared in :mod:`posterior_fusion.flower.round_settings`): out-dir, val, on-bad-reply, min-nodes,
  round-timeout, max-memory, and silo-dir (read by the nodes);
- the refresh round (``pfuse refresh`` on every node, then fuse again): refresh (bool),
  refresh-damping (``refresh --damping``);
- one network (``fuse --distill`` after the collection): distill (bool), unlabeled (the server's unlabeled inputs;
  without them the consistent recipe synthesises its inputs), distill-recipe, distill-epochs and the consistent
  recipe's distill-<setting> (distill-steps, distill-lr, …: the same names and defaults as fuse's options);
- secure aggregation (Flower's SecAgg+: the server gets sums over the nodes only; fedavg, fisher-merge, product
  with diag): secure-aggregation (bool), secure-aggregation-clipping-range, secure-aggregation-max-weight,
  secure-aggregation-reconstruction-threshold, and base (the server's copy of the base, which a secure round
  also writes the global from) (:mod:`posterior_fusion.flower.secure`);
- the fusion: method, robust, fuse-temperature, fuse-prior-var, allow-mixed-privacy, batchnorm-statistics (``fuse
  --batchnorm-statistics``: reset estimates the statistics on ``val``'s inputs), and every setting of the method
  as ``set.<name>`` (a TOML table ``[tool.flwr.app.config.set]``), e.g. ``set.steps = 300`` (names that are not
  the chosen method's settings are named in the log and not used, so the table may hold another method's).
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from posterior_fusion.errors import ConfigError, PfuseError
from posterior_fusion.flower.client_app import make_client_app
from posterior_fusion.flower.federated_settings import FederatedSettings
from posterior_fusion.flower.round_settings import SECURE_MIN_NODES, RoundSettings
from posterior_fusion.flower.secure import SecureAggregation, run_secure_round
from posterior_fusion.flower.server_app import run_round
from posterior_fusion.fusion import FusionOptions, applicable_settings
from posterior_fusion.fusion.distill import DistillConfig, distill_config
from posterior_fusion.fusion.distill_settings import RecipeChoice, TeachingConfig
from posterior_fusion.fusion.registry import resolve_default
from posterior_fusion.settings import from_run_config as settings_from_run_config
from posterior_fusion.settings import given_in_run_config

clientapp = make_client_app()
serverapp = ServerApp()


def check_secure_run_config(round_settings: RoundSettings) -> None:
    """What a secure round cannot do, refused before any message: the refresh round, screening and server data
    (each reads one client's artifact)."""
    for key, wanted in (("refresh", round_settings.refresh), ("robust", round_settings.robust),
                        ("val", bool(round_settings.val)), ("unlabeled", bool(round_settings.unlabeled)),
                        ("distill", round_settings.distill),
                        ("batchnorm-statistics", round_settings.batchnorm_statistics != "fold")):
        if wanted:
            raise ConfigError(f"run config `{key}` needs each client's artifact on the server; secure aggregation "
                              "gives it only sums over the clients: unset one of them")


def distill_from_run_config(cfg: dict[str, Any], round_settings: RoundSettings) -> DistillConfig | TeachingConfig | None:
    """The distillation record of a round (run config ``distill`` and ``distill-*``: the same settings as
    ``fuse --distill``'s, :func:`~posterior_fusion.fusion.distill.distill_config`); a recipe's key without
    ``distill = true`` is refused in one line."""
    recipe = settings_from_run_config(RecipeChoice, cfg, prefix="distill-")
    teaching = given_in_run_config(TeachingConfig, cfg, prefix="distill-")
    given = [*given_in_run_config(RecipeChoice, cfg, prefix="distill-"), *teaching]
    if not round_settings.distill:
        if given:
            raise ConfigError(f"run config `distill-{given[0].replace('_', '-')}` applies with `distill` = true only")
        return None
    return distill_config(recipe, teaching, bool(round_settings.unlabeled), where="run config: ")


def fusion_from_run_config(cfg: dict[str, Any]) -> tuple[str, FusionOptions, dict[str, Any], bool]:
    """(method, shared options, the method's settings, robust) from a flat Flower run config."""
    r = RoundSettings.from_run_config(cfg)
    settings = {k[len("set."):]: v for k, v in cfg.items() if k.startswith("set.")}
    options = FusionOptions(temperature=r.fuse_temperature, prior_var=r.fuse_prior_var, progress=False,
                            batchnorm_statistics=r.batchnorm_statistics, allow_mixed_privacy=r.allow_mixed_privacy)
    method, settings = resolve_default(r.method, settings)
    kept = applicable_settings(method, settings)  # the table may hold another method's settings, as a grid's does
    if set(settings) - set(kept):
        print(f"run config: {', '.join('set.' + k for k in sorted(set(settings) - set(kept)))} "
              f"{'is not a setting' if len(settings) - len(kept) == 1 else 'are not settings'} of {method}: not used")
    return method, options, kept, r.robust


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    """The server's round (:func:`serve`). Flower logs any exception the ServerApp raises with its traceback
    and marks the run failed: a pfuse error (bad run config, a refused artifact) is raised again from here with
    the traceback cut to this frame, so the log ends in its one line and the run still counts as failed."""
    try:
        serve(grid, context)
    except PfuseError as exc:
        raise exc.with_traceback(None) from None


def serve(grid: Grid, context: Context) -> None:
    """Fit every node's silo, fuse the replies (or their secure sums) and write the global (run config above)."""
    cfg = dict(context.run_config)
    r = RoundSettings.from_run_config(cfg)
    method, options, settings, robust = fusion_from_run_config(cfg)
    if r.secure_aggregation:
        check_secure_run_config(r)
        run_secure_round(grid, context, FederatedSettings.from_run_config(cfg), r.out_dir, method, options, settings,
                         SecureAggregation.from_run_config(cfg), min_nodes=max(r.min_nodes, SECURE_MIN_NODES),
                         round_timeout=r.round_timeout, base=r.base)
        return
    run_round(grid, FederatedSettings.from_run_config(cfg), r.out_dir, method=method, options=options, val_path=r.val,
              on_bad_reply=r.on_bad_reply, min_nodes=r.min_nodes, method_settings=settings, max_memory=r.max_memory,
              robust=robust, round_timeout=r.round_timeout, refresh=r.refresh, refresh_damping=r.refresh_damping,
              base=r.base, unlabeled_path=r.unlabeled, distill=distill_from_run_config(cfg, r))
