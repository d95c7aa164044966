"""The registry's record of a fusion method (:class:`FusionMethod`): what it is, needs and costs, declared beside it, and the memory-cost helpers its entries use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posterior_fusion.errors import MethodNotApplicableError
from posterior_fusion.fusion.client_sums import ClientSums
from posterior_fusion.fusion.settings_parsing import MethodSettings
from posterior_fusion.fusion.types import FusionInputs, FusionResult


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
