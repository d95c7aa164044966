"""Secure aggregation: the round where the server sees only sums over the silos (Flower's SecAgg+).

For a method whose server step reads the clients through sums alone (:class:`~posterior_fusion.fusion.client_sums.ClientSums`:
FedAvg, Fisher merge, the product of Gaussians with diagonal curvature), each node fits its silo as in the plain
round, keeps its artifact, computes the method's statistics ``s_c`` from it and sends them through Flower's
SecAgg+ protocol (:class:`flwr.server.workflow.SecAggPlusWorkflow` on the server, ``secaggplus_mod`` on the node):
the server unmasks only ``Σ_c s_c`` and fuses from it. No artifact, MAP or curvature of one silo reaches it.

What travels in the clear: the run's settings (sent by the server), each node's sample count ``n_c`` (SecAgg+'s
weight), its input transform and class names (shared by every silo; checked equal) and, for a private fit, its
(ε, δ) (recorded in the global's ``secure_aggregation.dp``). The statistics travel as
``s_c / n_c``, which SecAgg+ weights by ``n_c``: the server gets ``Σ_c s_c / Σ_c n_c`` and multiplies back. SecAgg+
quantises each value in ``[-clipping_range, clipping_range]`` to ``quantization_range`` levels (stochastic rounding,
unbiased); a node whose statistics leave that range refuses in one line instead of being clipped.

Kronecker-factored curvature cannot be summed this way (a sum of Kronecker products is not one), nor can methods
that read each client on its own (fedbens' mixtures, the ensembles, FedLPA, RegMean's Gram inversion per client…). A run that fine-tunes a
pretrained base needs the server's own copy of it (run config ``base``, checked against ``base-sha256``), sent once
to every node with the fit instructions.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server import ServerConfig
from flwr.server.compat import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid

from posterior_fusion.artifact import load_client, write_global_artifact
from posterior_fusion.errors import ConfigError, FederationError
from posterior_fusion.files import check_output
from posterior_fusion.flower.pretrained_base import base_to_send
from posterior_fusion.fusion.client_sums import SumsContext
from posterior_fusion.fusion.from_posteriors import method_settings as chosen_settings
from posterior_fusion.fusion.registry import METHODS, get_method
from posterior_fusion.fusion.types import FusionInputs, FusionOptions, prior_precision_of
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.local.init import finetune_start
from posterior_fusion.settings import check_declared, declared_default, setting
from posterior_fusion.settings import from_run_config as settings_from_run_config


def secure_methods() -> str:
    """The registry's methods that run from sums, with the structures they need: ``"fedavg, product (diag), …"``."""
    out = []
    for name in METHODS:
        sums = METHODS[name].sums
        if sums is not None:
            out.append(name + (f" ({', '.join(sums.structures)})" if sums.structures else ""))
    return ", ".join(out)


@dataclass(frozen=True)
class SecureAggregation:
    """SecAgg+'s settings (run config ``secure-aggregation-*``): ``clipping_range``: every value a node sends lies in
    ``[-clipping_range, clipping_range]`` (a node outside refuses); ``max_weight``: the largest silo's sample count
    (SecAgg+ weights by ``n_c / max_weight``); ``reconstruction_threshold``: the fraction of nodes whose shares
    rebuild a dropped node's mask (more: more private, less tolerant of dropouts)."""

    clipping_range: float = setting(8.0, "Every value a node sends lies in [-r, r] (a node outside refuses).",
                                    bounds=(1e-12, 1e12))
    max_weight: int = setting(100_000, "The largest silo's sample count (SecAgg+ weights by n_c / max_weight).",
                              bounds=(1, 10**12))
    reconstruction_threshold: float = setting(0.67, "The fraction of nodes whose shares rebuild a dropped node's mask "
                                                    "(more: more private, less tolerant of dropouts).",
                                              bounds=(0.5, 1.0))

    def validate(self) -> None:
        check_declared(self, "run config", prefix="secure_aggregation_", dashed=True)

    def quantization_range(self, nodes: int) -> int:
        """Levels per value: the largest power of two with ``nodes`` quantised values summing below SecAgg+'s
        modulus 2³² (at most 2³⁰: a quantised value is an int32)."""
        return 1 << min(30, 32 - math.ceil(math.log2(max(nodes, 2))))

    @classmethod
    def from_run_config(cls, cfg: dict[str, Any]) -> SecureAggregation:
        """The settings from the run config's ``secure-aggregation-*`` keys, converted to their declared types and
        checked (one :class:`ConfigError` line naming the key)."""
        return settings_from_run_config(cls, cfg, "secure-aggregation-")


def check_secure_round(method: str, structure: str, base_sha256: str | None, base: str | Path | None) -> None:
    """Refuse, before any message, a round that cannot run from sums: a method without them, a structure its
    statistics do not cover, or a fine-tuned base the server holds no copy of (it writes the global from it)."""
    entry = get_method(method)
    if entry.sums is None:
        raise ConfigError(f"method {method!r} cannot run under secure aggregation: its server step reads each client "
                          f"on its own, not sums over them (the methods that can: {secure_methods()})")
    if entry.sums.structures is not None and structure not in entry.sums.structures:
        raise ConfigError(f"method {method!r} runs from sums with curvature structure "
                          f"{', '.join(entry.sums.structures)} only, the run asks for {structure!r}")
    if base_sha256 and base is None:
        raise ConfigError("the run fine-tunes a pretrained base: under secure aggregation the server writes the global "
                          "model from its own copy of it: set run config `base` to that file")


@dataclass
class _SumsStrategy(Strategy):
    """The strategy SecAgg+ calls: every connected node gets the fit instructions; the aggregate is kept."""

    config: dict[str, str | bytes]
    min_nodes: int
    wait_s: float
    aggregate: list[np.ndarray] | None = None
    weights: list[int] = field(default_factory=list)
    public: list[str] = field(default_factory=list)
    failures: int = 0

    def initialize_parameters(self, client_manager):
        return Parameters(tensors=[], tensor_type="numpy.ndarray")

    def configure_fit(self, server_round, parameters, client_manager):
        client_manager.wait_for(self.min_nodes, timeout=int(self.wait_s))
        n = client_manager.num_available()
        if n < max(self.min_nodes, 2):
            raise FederationError(f"secure aggregation needs at least {max(self.min_nodes, 2)} nodes, {n} connected")
        return [(proxy, FitIns(parameters, dict(self.config))) for proxy in client_manager.sample(n, n)]

    def aggregate_fit(self, server_round, results, failures):
        self.failures = len(failures)
        if results:
            self.aggregate = parameters_to_ndarrays(results[0][1].parameters)
            self.weights = [int(res.num_examples) for _, res in results]
            self.public = [str(res.metrics.get("public", "")) for _, res in results]
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def run_secure_round(grid: Grid, context: Context, settings, out_dir: str | Path, method: str,
                     options: FusionOptions, method_settings: Any, secure: SecureAggregation, min_nodes: int = 2,
                     wait_s: float = 120.0, round_timeout: float = 0.0, log: Callable[[str], None] = print,
                     base: str | Path | None = None) -> dict:
    """Server side: fit instructions out, Flower's SecAgg+ round, the global fused from the unmasked sums alone
    (``out_dir/global.h5``; metadata ``secure_aggregation``). ``base``: the server's copy of the base the run
    fine-tunes (``settings.base_sha256``), the fine-tuning spec and the prior's centre rebuilt from it as every
    node does. Returns the metadata."""
    check_secure_round(method, settings.structure, settings.base_sha256, base)
    spec, prior_mean = settings.spec(), None
    server_base = base_to_send(spec, settings.base_sha256, base)
    sent = None
    if server_base is not None:
        sent, spec, weights = server_base
        spec, _, prior_mean = finetune_start(spec, weights, settings.finetune, 1, settings.init_seed)
        prior_mean = prior_mean.double()
    secure.validate()
    options.validate()
    chosen = chosen_settings(method, method_settings)
    out = Path(out_dir)
    check_output(out / "global.h5")
    t0 = time.time()
    while len(grid.get_node_ids()) < max(min_nodes, 2) and time.time() - t0 < wait_s:
        time.sleep(0.2)
    nodes = len(grid.get_node_ids())
    q = secure.quantization_range(nodes)
    fusion = {"method": method, "component": options.component, "temperature": options.temperature,
              "prior_var": options.prior_var, "clipping_range": secure.clipping_range, "max_weight": secure.max_weight}
    strategy = _SumsStrategy({"settings": settings.to_json(), "secure-sums": json.dumps(fusion),
                              **({"base": sent} if sent is not None else {})}, max(min_nodes, 2), wait_s)
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
        num_shares=1.0, reconstruction_threshold=secure.reconstruction_threshold, max_weight=secure.max_weight,
        clipping_range=secure.clipping_range, quantization_range=q, timeout=round_timeout or None))
    log(f"secure aggregation (SecAgg+) over {nodes} nodes: {method}")
    workflow(grid, LegacyContext(context, config=ServerConfig(num_rounds=1), strategy=strategy))
    if strategy.aggregate is None:
        raise FederationError("the secure aggregation did not complete (too few nodes answered: see Flower's log)")
    replies = [json.loads(p or "{}") for p in strategy.public]
    guarantees = sorted((r.pop("dp", None) or {} for r in replies), key=lambda g: (g.get("epsilon", 0), g.get("delta", 0)))
    public = {json.dumps(r, sort_keys=True) for r in replies}
    if len(public) != 1:
        raise FederationError("the nodes' silos differ in input transform or class names: no fusion across them")
    shared = json.loads(public.pop())
    if shared.get("base_sha256") != settings.base_sha256:
        raise FederationError("the nodes fine-tuned another base than the run's")
    n_total = sum(strategy.weights)
    sums = [torch.from_numpy(np.asarray(a, dtype=np.float64)) * n_total for a in strategy.aggregate]
    entry = get_method(method)
    lam0 = prior_precision_of(options.prior_var if options.prior_var is not None else settings.prior_var)
    result = entry.sums.finish(sums, SumsContext(spec, len(strategy.weights), n_total, lam0, prior_mean), chosen)
    meta = {"method": method, "options": asdict(options), "settings": asdict(chosen),
            "structure": settings.structure, "server_prior_precision": lam0, "provenance": [],
            "input_transform": shared.get("input_transform"), **({"class_names": shared["class_names"]}
                                                                 if shared.get("class_names") else {}),
            "base_sha256": settings.base_sha256, "validation": None, **result.info,
            "secure_aggregation": {"protocol": "SecAgg+ (flwr)", "clients": len(strategy.weights), "n_data": n_total,
                                   "left_out": strategy.failures, "clipping_range": secure.clipping_range,
                                   "quantization_range": q, "max_weight": secure.max_weight,
                                   "reconstruction_threshold": secure.reconstruction_threshold,
                                   "dp": guarantees if any(guarantees) else None},
            "federation": {"engine": "flower", "nodes": nodes, "settings": json.loads(settings.to_json())}}
    write_global_artifact(out / "global.h5", spec, ParameterLayout.from_model(spec.build()), meta, result.members)
    log(f"wrote {out / 'global.h5'} from the secure sums of {len(strategy.weights)} nodes")
    return meta


def is_secure_fit(msg: Message) -> bool:
    """Whether a train message is a step of the SecAgg+ round (else the plain round's)."""
    return RECORD_KEY_CONFIGS in msg.content.config_records or "fitins.config" in msg.content.config_records


def secure_sums_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod`` on the SecAgg+ round's messages, nothing on the plain round's."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def secure_statistics(artifact: str | Path, fusion: dict[str, Any], clipping_range: float,
                      max_weight: float) -> tuple[list[np.ndarray], int, dict]:
    """A node's reply to the collect stage: its statistics ``s_c / n_c`` (the method's ``local`` on its own
    artifact), ``n_c`` and the shared public fields; refused in one line if a value leaves the clipping range or
    ``n_c`` exceeds ``max_weight``."""
    client = load_client(artifact)
    entry = get_method(str(fusion["method"]))
    if entry.sums is None:
        raise FederationError(f"method {fusion['method']!r} has no secure sums")
    options = FusionOptions(temperature=fusion.get("temperature"), prior_var=fusion.get("prior_var"),
                            component=int(fusion.get("component", declared_default(FusionOptions, "component"))), progress=False)
    options.validate()
    n = client.n_data
    if n > max_weight:
        raise FederationError(f"this silo holds {n} samples, more than the run's secure-aggregation-max-weight "
                              f"{max_weight:g}")
    stats = [(s / n).numpy() for s in entry.sums.local(FusionInputs([client], options), entry.settings())]
    largest = max(float(np.abs(s).max()) for s in stats)
    if not math.isfinite(largest) or largest > clipping_range:
        raise FederationError(f"this silo's statistics reach {largest:.4g}, outside the run's "
                              f"secure-aggregation-clipping-range {clipping_range:g}: raise it")
    init, dp = client.metadata.get("init"), client.metadata.get("dp")
    public = {"input_transform": client.metadata.get("input_transform"),
              "class_names": client.metadata.get("class_names"),
              "base_sha256": init.get("base_sha256") if isinstance(init, dict) else None,
              "dp": {k: dp[k] for k in ("epsilon", "delta")} if isinstance(dp, dict) else None}
    return stats, n, public


def secure_fit_reply(msg: Message, artifact: str | Path) -> Message:
    """The collect stage's reply in Flower's legacy fit format (what ``secaggplus_mod`` masks)."""
    config = msg.content.config_records["fitins.config"]
    fusion = json.loads(str(config["secure-sums"]))
    stats, n, public = secure_statistics(artifact, fusion, float(fusion["clipping_range"]), float(fusion["max_weight"]))
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(stats), n, {"public": json.dumps(public, sort_keys=True)})
    return Message(compat.fitres_to_recorddict(res, False), reply_to=msg)
