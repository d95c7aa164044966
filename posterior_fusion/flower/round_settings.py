"""The server's run-config keys for one Flower round (``flwr run`` with ``examples/flower/``), declared once with
:func:`~posterior_fusion.settings.setting`: every key's default, help, bounds and choices live here, and
:meth:`RoundSettings.from_run_config` reads them by their names as the run config spells them (``min-nodes`` for
``min_nodes``). The fit settings the server sends to every node are :class:`~posterior_fusion.flower.federated_settings.FederatedSettings`';
a method's own are ``set.<name>``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posterior_fusion import ranges
from posterior_fusion.choices import BatchnormStatistics, Choice
from posterior_fusion.local.refresh_settings import REFRESH_DAMPING, TRUST_RADIUS
from posterior_fusion.settings import from_run_config as settings_from_run_config
from posterior_fusion.settings import setting


class OnBadReply(Choice):
    """What the server does with a reply that is no valid artifact."""

    SKIP = "skip", "leave it out of the fusion, named in the log"
    FAIL = "fail", "fail the round"


SECURE_MIN_NODES = 2  # a secure round sums at least this many replies, whatever min-nodes says (one reply's sum is itself)


@dataclass(frozen=True)
class RoundSettings:
    """One round's server settings (run config keys: the field names with ``-`` for ``_``)."""

    out_dir: str = setting("flower-run", "Where the server writes the clients' artifacts and the global.")
    val: str | None = setting(None, "The server's validation data file (fuse --val).")
    unlabeled: str | None = setting(None, "The server's unlabeled inputs (fuse --unlabeled): fedbe's and distill's "
                                          "data.")
    distill: bool = setting(False, "Serve one network: after the collection, teach one student what the fused "
                                   "predictive knows (fuse --distill; its recipe's keys are distill-recipe, "
                                   "distill-epochs and the consistent recipe's distill-<setting>).")
    on_bad_reply: str = setting("skip", "A reply that is no valid artifact.", choices=OnBadReply)
    min_nodes: int = setting(1, f"Fuse once at least this many replies arrived (a secure round needs at least "
                                f"{SECURE_MIN_NODES} whatever this says).", bounds=(1, 100000))
    round_timeout: float = setting(0.0, "Seconds to wait for the replies (0: Flower's default).", bounds=(0.0, 1e7))
    max_memory: str | None = setting(None, "Refuse work estimated above this size, e.g. 8G (fuse --max-memory).")
    refresh: bool = setting(False, "Run the refresh round after the first fusion (pfuse refresh on every node).")
    refresh_damping: str = setting(str(REFRESH_DAMPING), "The refresh round's damping (refresh --damping): a number, "
                                                         "or auto.")
    secure_aggregation: bool = setting(False, "Flower's SecAgg+: the server gets sums over the nodes only (fedavg, "
                                              "fisher-merge, the diagonal product).")
    base: str | None = setting(None, "The server's copy of the pretrained base the run fine-tunes (sent once in "
                                     "every train message).")
    method: str | None = setting(None, "The fusion method (None: fuse's default).")
    robust: bool = setting(False, "Screen out outlying clients (fuse --robust).")
    fuse_temperature: float | None = setting(None, "Re-temper every client on the server (fuse --temperature).",
                                             bounds=ranges.TEMPERATURE)
    fuse_prior_var: float | None = setting(None, "Re-set every client's prior variance (fuse --prior-var).",
                                           bounds=ranges.PRIOR_VAR)
    allow_mixed_privacy: bool = setting(False, "Fuse differentially private clients with non-private ones.")
    batchnorm_statistics: str = setting("fold", "The fused model's BatchNorm statistics (reset: on val's inputs).",
                                        choices=BatchnormStatistics)
    silo_dir: str | None = setting(None, "A simulation's silo folder: the node of partition-id k trains on its "
                                         "client_k.h5 (a deployment's node names its own silo).")

    @classmethod
    def from_run_config(cls, cfg: dict[str, Any]) -> RoundSettings:
        """The round's settings from a flat run config (other keys — fit settings, ``set.*`` — are left to their
        readers); each value converted to its declared type and checked, one :class:`ConfigError` line otherwise."""
        return settings_from_run_config(cls, cfg)


@dataclass(frozen=True)
class NodeSettings:
    """One node's own settings (its node config, ``flower-supernode --node-config``: the field names with ``-``
    for ``_``); the local model's keys are fit settings (``local-model``, …) and the private refresh round's
    ``refresh-dp-*``, each read by its own record."""

    silo: str | None = setting(None, "The node's silo file (else the run's silo-dir with partition-id).")
    partition_id: int | None = setting(None, "The node's partition in a simulation (its silo-dir's client_<id>.h5).",
                                       bounds=(0, 10**9))
    state_dir: str | None = setting(None, "Where the node keeps its artifacts between rounds [default: the "
                                          "user's data folder, posterior-fusion/node/<hash of the silo's path>].")
    base: str | None = setting(None, "The node's copy of the pretrained base the run fine-tunes (else the one "
                                     "the train message carries).")
    refresh_trust_radius: float = setting(TRUST_RADIUS, "The refresh round's bound on a member's per-parameter "
                                                        "squared distance from the node's own posterior (refresh "
                                                        "--trust-radius).", bounds=ranges.TRUST_RADIUS)

    @classmethod
    def from_node_config(cls, cfg: dict[str, Any]) -> NodeSettings:
        """The node's settings from its node config (other keys left to their readers); one :class:`ConfigError`
        line naming a bad key."""
        return settings_from_run_config(cls, cfg, where="node config")
