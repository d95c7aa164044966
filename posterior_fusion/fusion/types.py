"""Types shared by all fusion methods: the shared options, the inputs, the result, the
registry record of a method, and the checks every method uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.curvature import BlockDiag
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import ConfigError, IncompatibleArtifactsError, MethodNotApplicableError
from posterior_fusion.fusion.options import DEVICES, KERNELS, FusionOptions  # noqa: F401 (the shared options, here too)
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.models import ModelSpec
from posterior_fusion.pooling import AVERAGE, Pooling


def prior_precision_of(prior_var: float) -> float:
    """λ0 = 1 / σ0²: the one conversion between the user-facing variance and the stored precision."""
    return 1.0 / prior_var


@dataclass
class FusionInputs:
    """What a method gets: validated clients, shared options, optional server data."""

    clients: list[ClientPosterior]
    options: FusionOptions = field(default_factory=FusionOptions)
    val: SiloData | None = None
    unlabeled: SiloData | None = None

    @property
    def spec(self) -> ModelSpec:
        return self.clients[0].model_spec

    def temperature(self, c: ClientPosterior) -> float:
        return self.options.temperature if self.options.temperature is not None else c.temperature

    def prior_precision(self, c: ClientPosterior) -> float:
        return prior_precision_of(self.options.prior_var) if self.options.prior_var is not None else c.prior_precision

    def server_prior_precision(self) -> float:
        """λ0 of the global prior: the override, else the median of the clients' λ0."""
        if self.options.prior_var is not None:
            return prior_precision_of(self.options.prior_var)
        vals = sorted(c.prior_precision for c in self.clients)
        return vals[len(vals) // 2]

    def prior_mean(self) -> torch.Tensor | None:
        """The centre of the clients' shared prior ``N(μ0, λ0⁻¹ I)``, ``(d,)`` float64: the pretrained base they
        fine-tuned, or ``None`` for zero (random starting points); :func:`check_compatible` made them equal."""
        mean = self.clients[0].prior_mean
        return None if mean is None else mean.double()

    def mode_maps(self, m: int | None = None) -> torch.Tensor:
        """MAP of component ``m`` (default ``options.component``) of every client, ``(C, d)``."""
        m = self.options.component if m is None else m
        for c in self.clients:
            if m >= c.num_components:
                raise ConfigError(f"{c.path}: has {c.num_components} components, component {m} requested")
        return torch.stack([c.components[m].map.float() for c in self.clients])

    def n_weights(self) -> torch.Tensor:
        n = torch.tensor([c.n_data for c in self.clients], dtype=torch.float32)
        return n / n.sum()


@dataclass
class FusionResult:
    """Ensemble members (independent ``(d,)`` tensors) plus method-specific information."""

    members: list[torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)
    curvatures: list[BlockDiag] | None = None  # raw Laplace curvature per member (precision = curvature + λ0 I)

    # info fields indexed by member: how the members' predictions combine and where they came from (they go
    # with the members)
    COMBINATION_KEYS = ("mode_weights", "pooling", "members_from_starts")

    @property
    def mode_weights(self) -> torch.Tensor | None:
        """The mixture weights π ``(K,)`` the method stored, else ``None`` (uniform)."""
        w = self.info.get("mode_weights")
        return None if w is None else torch.tensor(w, dtype=torch.float64)

    def pooling(self, num_classes: int) -> Pooling:
        """How the members' predictions combine (:mod:`posterior_fusion.pooling`)."""
        raw = self.info.get("pooling")
        return AVERAGE if raw is None else Pooling.from_metadata(raw, len(self.members), num_classes)

    def distilled(self, w: torch.Tensor, record: dict[str, Any]) -> FusionResult:
        """The result once its members are distilled into the one model ``w`` ``(d,)``: the
        members' combination fields leave with them, the distillation ``record`` is added."""
        info = {k: v for k, v in self.info.items() if k not in self.COMBINATION_KEYS}
        return FusionResult([w], {**info, "distill": record})


@dataclass(frozen=True)
class FuseSize:
    """What a memory estimate knows before anything is loaded: ``d`` parameters, ``clients``
    artifacts, ``components`` per client."""

    d: int
    clients: int
    components: int


def one_member(settings: Any, size: FuseSize) -> int:
    return 1


def optimiser_bytes(settings: Any, size: FuseSize) -> int:
    """A one-mode optimiser over every component (autograd keeps about 4 parameter vectors each)."""
    return 4 * size.clients * size.components * size.d * 4


def no_work(settings: Any, size: FuseSize) -> int:
    return 0


def always(settings: Any) -> bool:
    return True


def never(settings: Any) -> bool:
    return False


@dataclass(frozen=True)
class SumsContext:
    """What a server that holds only sums over clients knows besides them: the model, how many clients and samples
    the sums cover, and the global prior ``N(prior_mean, prior_precision⁻¹ I)`` (``prior_mean`` ``(d,)`` float64, or
    ``None`` for zero)."""

    spec: ModelSpec
    clients: int
    n_data: int
    prior_precision: float
    prior_mean: torch.Tensor | None = None


@dataclass(frozen=True)
class ClientSums:
    """A method whose server step reads the clients only through sums ``Σ_c s_c`` of per-client statistics, so a
    secure aggregation can compute it without the server seeing any one client's ``s_c``.

    ``local(inputs, settings)``: the statistics ``s_c`` of the one client in ``inputs``, a list of float64 tensors
    (their shapes depend on the model only); ``finish(sums, context, settings)``: the result from the element-wise
    sums of those lists over the clients; ``structures``: the curvature structures ``local`` accepts (None: all).
    The method's own ``run`` is :meth:`run`, ``finish`` over the sums of ``local``, so the two paths are one
    computation."""

    local: Callable[[FusionInputs, Any], list[torch.Tensor]]
    finish: Callable[[list[torch.Tensor], SumsContext, Any], FusionResult]
    structures: tuple[str, ...] | None = None

    def run(self, inputs: FusionInputs, settings: Any) -> FusionResult:
        """The method on clients that are all at hand: ``finish`` over :func:`sum_over_clients`."""
        return self.finish(sum_over_clients(inputs, self, settings), sums_context(inputs), settings)


def sum_over_clients(inputs: FusionInputs, sums: ClientSums, settings: Any) -> list[torch.Tensor]:
    """``[Σ_c s_c]``: each client's statistics (``sums.local`` on that client alone) summed element-wise."""
    total: list[torch.Tensor] | None = None
    for c in inputs.clients:
        s = sums.local(FusionInputs([c], inputs.options, inputs.val, inputs.unlabeled), settings)
        total = s if total is None else [a + b for a, b in zip(total, s, strict=True)]
    if total is None:
        raise IncompatibleArtifactsError("no client artifacts given")
    return total


def sums_context(inputs: FusionInputs) -> SumsContext:
    """The :class:`SumsContext` of clients that are all at hand."""
    return SumsContext(inputs.spec, len(inputs.clients), sum(c.n_data for c in inputs.clients),
                       inputs.server_prior_precision(), inputs.prior_mean())


NEEDS = {"unlabeled": "unlabeled server data", "students": "FedPPD students", "swag_moments": "SWAG moments"}


@dataclass(frozen=True)
class FusionMethod:
    """A registry entry: what a method is, needs and costs, declared beside it (no other module
    branches on a method's name).

    ``run(inputs, settings)``; ``settings``: its settings record; ``summary``: its one line (help,
    demo legend, docs); ``optimises``: runs Adam over the parameters (progress); ``members``:
    networks it serves per prediction, from settings and sizes alone; ``work_bytes``: its
    working set beyond the loaded artifacts (memory estimate); ``distils``: it distils into one
    model by itself (``--distill`` is not applied again); ``tunable``: T and σ0² can be chosen
    on validation data (``--tune``, the experiment grids' ``tune``); ``structures``: the curvature
    structures it can fuse (None: all), so lists such as the demo's offer it only where it applies;
    ``needs``: what its inputs must hold (:data:`NEEDS`); ``dense_copies``: how many copies of the dense
    factors of every compressed Kronecker block it holds at its peak (rebuilt, decomposed, stacked;
    measured by ``benchmarks/compact_memory.py``), for the memory estimate; ``sums``: how it runs from sums
    over clients alone (:class:`ClientSums`: secure aggregation), or None; ``uses_curvature``: whether, with
    these settings, it reads the clients' curvature (where not, ``fuse`` validates each block and keeps none).
    """

    name: str
    run: Callable[[FusionInputs, Any], FusionResult]
    settings: type[MethodSettings] = MethodSettings
    summary: str = ""
    optimises: bool = False
    members: Callable[[Any, FuseSize], int] = one_member
    work_bytes: Callable[[Any, FuseSize], int] = no_work
    distils: bool = False
    tunable: bool = False
    structures: tuple[str, ...] | None = None
    needs: tuple[str, ...] = ()  # of NEEDS: checked before any work (:meth:`check_needs`)
    dense_copies: float = 0.0  # peak copies of a compressed Kronecker block's dense factors it holds (memory estimate)
    sums: ClientSums | None = None
    uses_curvature: Callable[[Any], bool] = always

    def applies_to(self, structure: str) -> bool:
        return self.structures is None or structure in self.structures

    def check_needs(self, clients: Sequence[Any] | None = None, unlabeled: object | None = None,
                    component: int | None = None) -> None:
        """What the method needs, before any work: ``"unlabeled"`` server data (``unlabeled`` given:
        a file or the data), and in every client component (``component``: that one only, else all) a
        FedPPD student (``"students"``) or SWAG moments (``"swag_moments"``). One :class:`MethodNotApplicableError` line."""
        if "unlabeled" in self.needs and unlabeled is None:
            raise MethodNotApplicableError(f"method {self.name!r} needs unlabeled server data (`unlabeled` FILE)")
        for need, held, how in (("students", lambda comp: comp.student, "fit-local `ppd`"),
                                ("swag_moments", lambda comp: comp.swag, "fit-local `swag`")):
            if need not in self.needs or clients is None:
                continue
            for c in clients:
                comps = c.components if component is None else [c.components[component]]
                bare = next((comp for comp in comps if held(comp) is None), None)
                if bare is not None:
                    raise MethodNotApplicableError(f"method {self.name!r} needs {NEEDS[need]}; {c.path} component "
                                                   f"{bare.index} has none ({how})")

    def __call__(self, inputs: FusionInputs, settings: MethodSettings | None = None) -> FusionResult:
        return self.run(inputs, settings if settings is not None else self.settings())


def check_compatible(clients: list[ClientPosterior], allow_mixed_privacy: bool = False) -> None:
    """Refuse sets that cannot be fused, naming the first offending file (differentially private clients beside
    non-private ones only without ``allow_mixed_privacy``)."""
    if not clients:
        raise IncompatibleArtifactsError("no client artifacts given")
    for c in clients:
        if c.metadata.get("partial"):
            raise IncompatibleArtifactsError(f"{c.path}: is the partial file of an interrupted fit-local run, not a "
                                             "finished artifact (finish it with fit-local `resume`)")
    ref = clients[0]
    for c in clients[1:]:
        if c.model_spec != ref.model_spec:
            raise IncompatibleArtifactsError(f"{c.path}: model {c.model_spec.to_json()} differs from {ref.path}'s {ref.model_spec.to_json()}")
        if c.layout != ref.layout:
            raise IncompatibleArtifactsError(f"{c.path}: parameter layout differs from {ref.path}")
    bases = {c.path: (c.metadata.get("init") or {}).get("base_sha256") if isinstance(c.metadata.get("init"), dict)
             else None for c in clients}
    if len(set(bases.values())) > 1:
        odd = next(c for c in clients[1:] if bases[c.path] != bases[ref.path])
        said = {p: f"the base {str(sha)[:12]}…" if sha else "no pretrained base" for p, sha in bases.items()}
        raise IncompatibleArtifactsError(f"{odd.path}: fine-tuned from {said[odd.path]}, {ref.path} from "
                                         f"{said[ref.path]}: clients must share one base")
    if ref.model_spec.frozen_shapes():
        mine = ref.model_spec.frozen_vector()
        for c in clients[1:]:
            theirs = c.model_spec.frozen_vector()
            if not torch.equal(mine, theirs):
                moved = int((mine != theirs).sum()) if mine.shape == theirs.shape else len(theirs)
                raise IncompatibleArtifactsError(
                    f"{c.path}: its frozen base weights (/frozen) differ from {ref.path}'s in {moved} of {len(mine)} "
                    "values: every client must carry the federation's base bit for bit")
    for c in clients[1:]:
        a, b = ref.prior_mean, c.prior_mean
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            raise IncompatibleArtifactsError(f"{c.path}: its prior is centred at {'zero' if b is None else 'a base'}, "
                                             f"{ref.path}'s at {'zero' if a is None else 'another point'}: clients "
                                             "must share one prior (one base)")
    private = {c.path: isinstance(c.metadata.get("dp"), dict) for c in clients}
    if len(set(private.values())) > 1 and not allow_mixed_privacy:
        odd = next(c for c in clients[1:] if private[c.path] != private[ref.path])
        said = {True: "is differentially private", False: "is not differentially private"}
        raise IncompatibleArtifactsError(f"{odd.path}: {said[private[odd.path]]}, {ref.path} {said[private[ref.path]][3:]}"
                                         ": a fusion of both would not carry one guarantee (`allow_mixed_privacy` "
                                         "fuses them all the same)")
    names = {c.path: tuple(c.metadata.get("class_names") or ()) for c in clients}
    named = {v for v in names.values() if v}
    if len(named) > 1:
        odd = next(c for c in clients if names[c.path] and names[c.path] != next(iter(named)))
        raise IncompatibleArtifactsError(f"{odd.path}: names its classes differently from the other clients "
                                         f"({', '.join(list(names[odd.path])[:4])}, …)")
    def transform(c: ClientPosterior):  # what must agree (the ``source`` note need not)
        t = c.metadata.get("input_transform")
        return {k: v for k, v in t.items() if k != "source"} if isinstance(t, dict) else t

    ref_t = transform(ref)
    for c in clients[1:]:
        if transform(c) != ref_t:
            raise IncompatibleArtifactsError(f"{c.path}: trained with another input transform than {ref.path} "
                                             f"({c.metadata.get('input_transform')} vs {ref_t})")
    structures = {c.structure for c in clients}
    if len(structures) > 1:
        odd = next(c for c in clients if c.structure != ref.structure)
        raise IncompatibleArtifactsError(f"{odd.path}: curvature structure {odd.structure!r} differs from "
                                         f"{ref.path}'s {ref.structure!r}")
    shas = {}
    for c in clients:
        if c.sha256 in shas:
            raise IncompatibleArtifactsError(f"{c.path}: same content as {shas[c.sha256]} (a client given twice?)")
        shas[c.sha256] = c.path


def require_structures(inputs: FusionInputs, allowed: tuple[str, ...], method: str, hint: str = "") -> None:
    for c in inputs.clients:
        if c.structure not in allowed:
            raise MethodNotApplicableError(
                f"method {method!r} needs curvature structure {' or '.join(allowed)}; {c.path} has {c.structure!r}{hint}")


def require_equal_components(inputs: FusionInputs, method: str) -> int:
    ms = {c.num_components for c in inputs.clients}
    if len(ms) != 1:
        detail = ", ".join(f"{c.path}: M={c.num_components}" for c in inputs.clients)
        raise IncompatibleArtifactsError(f"method {method!r} needs the same number of mixtures M (components per client) on every client ({detail})")
    return ms.pop()
