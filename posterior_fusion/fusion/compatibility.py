"""The checks before any fusion: the clients can be fused together, and the structures and component counts a method needs."""

from __future__ import annotations

import torch

from posterior_fusion.artifact import ClientPosterior
from posterior_fusion.errors import IncompatibleArtifactsError, MethodNotApplicableError
from posterior_fusion.fusion.types import FusionInputs


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
