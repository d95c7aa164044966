"""Flower integration (optional extra ``posterior-fusion[flower]``): :mod:`.client_app`, :mod:`.server_app`,
:mod:`.federated_settings` (what the server sends), :mod:`.round_settings` (the server's run-config keys),
:mod:`.transfer` (files of any size in messages), :mod:`.secure` (SecAgg+ rounds), :mod:`.pretrained_base` (a shared
base), and :mod:`.apps` (the module-level apps ``flwr run`` names).

One-round federated fit-local + fuse on Flower (``pip install posterior-fusion[flower]``).

The ClientApp's train handler runs the same :func:`~posterior_fusion.local.fit.fit_local`
as ``pfuse fit-local`` on the node's silo and replies with the artifact, a file in chunks (:mod:`.transfer`). The
ServerApp sends the shared settings to every node, validates each reply with the same
reader as files (a bad or missing reply is logged and left out, or stops the run, per
``on_bad_reply``), runs :func:`~posterior_fusion.fusion.fuse` and saves the global
artifact plus the client artifacts it used.

Refresh round (``refresh``, a "1.5-shot" exchange): the server then sends each accepted node a
training-free ``query`` message with the global artifact and the SHA-256 of the node's own first
artifact; the node recaptures *its own copy* of that artifact — kept on its disk since the first
round (node config ``state-dir``, default a per-silo folder of the user's own, mode 0700, under ``~/.local/share``) —
never one the server sends, so model, structure, T and λ0 are the node's; the global is checked
against it first (:func:`~posterior_fusion.local.refresh.check_refresh_global`: the same model, at
most ``-M``'s cap of members, each within the node's trust radius — node config
``refresh-trust-radius``, the server cannot set it). It runs ``pfuse refresh`` on its silo
(``refresh_damping``) — private by the node's own settings (node config ``refresh-dp-epsilon``,
``refresh-dp-delta``, ``refresh-dp-clip``; ``refresh-dp-epsilon = "none"`` releases the exact gradient and a
new curvature; the server cannot set them either) — and replies with the refreshed artifact,
which the server validates like the first and fuses again into ``global_refreshed.h5`` (the one-shot
``global.h5`` stays). A node that fails the second message is left out of the refreshed fusion.

Which silo a node trains on: ``node_config["silo"]`` (deployment: ``flower-supernode
--node-config 'silo="/data/client_0.h5"'``), else ``<silo-dir>/client_<partition-id>.h5`` in
simulation (Flower sets ``partition-id``), with ``silo-dir`` from ``make_client_app(silo_dir)``
or the run config.


Importing it silences one notice of Ray's, the simulation backend: the FutureWarning "Tip: In future
versions of Ray, Ray will no longer override accelerator visible devices …" that ``ray.init`` prints
in every simulation (it concerns a change of Ray's defaults, not this run). Only that message is
filtered; Ray's behaviour is left as it is (``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO`` is not set).
"""

import warnings

warnings.filterwarnings("ignore", message=r"Tip: In future versions of Ray", category=FutureWarning)

from posterior_fusion.flower.client_app import (  # noqa: E402 - after the filter
    client_refresh,
    client_train,
    fit_to_artifact,
    make_client_app,
)
from posterior_fusion.flower.federated_settings import FederatedSettings  # noqa: E402
from posterior_fusion.flower.server_app import Reply, collect_replies, make_server_app, run_round  # noqa: E402

__all__ = ["FederatedSettings", "Reply", "client_refresh", "client_train", "collect_replies", "fit_to_artifact", "make_client_app",
           "make_server_app", "run_round"]
