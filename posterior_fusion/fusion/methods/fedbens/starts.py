"""Where FedBEns' modes start (the per-component median of the clients' MAPs, the MAPs
themselves, or both), the prior centres those starts imply, and the checks and damping of the
clients they start from."""

from __future__ import annotations

import dataclasses

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.errors import IncompatibleArtifactsError
from posterior_fusion.fusion.types import FusionInputs


def require_shared_inits(inputs: FusionInputs) -> None:
    """Refuse clients trained from different starting points (recorded ``init.fingerprint``)."""
    prints = [(c.path, (c.metadata.get("init") or {}).get("fingerprint")) for c in inputs.clients]
    known = [(p, f) for p, f in prints if f is not None]
    if len({f for _, f in known}) > 1:
        first = known[0]
        odd = next(p for p, f in known if f != first[1])
        raise IncompatibleArtifactsError(f"{odd}: trained from other starting points than {first[0]} (init fingerprints "
                                         "differ); use one init file or `init_seed` for every silo, or `set` "
                                         "allow_different_inits=true")


def damped_clients(clients: list[ClientPosterior], d: float) -> list[ClientPosterior]:
    """The clients with every component's curvature damped by ``d`` at per-sample scale
    (:meth:`~posterior_fusion.curvature.base.Precision.damped`, ``n`` = the client's sample count)."""
    return [dataclasses.replace(c, components=tuple(dataclasses.replace(comp, curvature=comp.curvature.damped(c.n_data, d))
                                                    for comp in c.components)) for c in clients]


def client_starts(inputs: FusionInputs) -> torch.Tensor:
    """``(C·M, d)``: every client component's MAP (client-major)."""
    return torch.stack([comp.map.float() for c in inputs.clients for comp in c.components])


def median_starts(inputs: FusionInputs, modes: int) -> torch.Tensor:
    """``(modes, d)``: element-wise median over clients of ŵ_cm for each mode index m."""
    return torch.stack([inputs.mode_maps(m).median(dim=0).values for m in range(modes)])


def start_rows(inputs: FusionInputs, starts: str, modes: int) -> tuple[torch.Tensor, list[int]]:
    """The starts ``(K, d)`` of ``starts`` (:data:`STARTS`) and the component index each row comes from
    (what its prior centre averages): the ``modes`` median starts, then, with ``clients``, every client
    component's MAP (client-major)."""
    rows = []
    if starts in ("median", "median+clients"):
        rows.append((median_starts(inputs, modes), list(range(modes))))
    if starts in ("clients", "median+clients"):
        rows.append((client_starts(inputs), [m for c in inputs.clients for m in range(c.num_components)]))
    return torch.cat([w for w, _ in rows]), [m for _, ms in rows for m in ms]


def client_centres(inputs: FusionInputs, components: list[int]) -> torch.Tensor:
    """``(K, d)``: for each start row's component index m, ``Σ_c λ_c ŵ_cm / Σ_c λ_c``."""
    lams = torch.tensor([inputs.prior_precision(c) for c in inputs.clients], dtype=torch.float64)
    means = {m: (lams[:, None] * inputs.mode_maps(m).double()).sum(0) / lams.sum() for m in set(components)}
    return torch.stack([means[m] for m in components]).float()
