"""Flower integration (optional extra ``posterior-fusion[flower]``); see :mod:`.federation`.

Importing it silences one notice of Ray's, the simulation backend: the FutureWarning "Tip: In future
versions of Ray, Ray will no longer override accelerator visible devices …" that ``ray.init`` prints
in every simulation (it concerns a change of Ray's defaults, not this run). Only that message is
filtered; Ray's behaviour is left as it is (``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO`` is not set).
"""

import warnings

warnings.filterwarnings("ignore", message=r"Tip: In future versions of Ray", category=FutureWarning)

from posterior_fusion.flower.federation import (  # noqa: E402 - after the filter
    FederatedSettings,
    Reply,
    client_refresh,
    client_train,
    collect_replies,
    fit_to_artifact,
    make_client_app,
    make_server_app,
    run_round,
)

__all__ = ["FederatedSettings", "Reply", "client_refresh", "client_train", "collect_replies", "fit_to_artifact", "make_client_app",
           "make_server_app", "run_round"]
