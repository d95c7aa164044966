"""Flower integration (optional extra ``posterior-fusion[flower]``); see :mod:`.federation`."""

from posterior_fusion.flower.federation import (
    FederatedSettings,
    Reply,
    client_train,
    collect_replies,
    fit_to_artifact,
    make_client_app,
    make_server_app,
    run_round,
)

__all__ = ["FederatedSettings", "Reply", "client_train", "collect_replies", "fit_to_artifact", "make_client_app",
           "make_server_app", "run_round"]
