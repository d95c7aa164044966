"""``refresh``: the silo's half of a refresh round, its own artifact recaptured at a fused global's members.

The **refresh round** (``pfuse refresh --at GLOBAL``; a "1.5-shot" exchange): the
client's Laplace approximations hold near its own MAPs, while the fused modes w*_k lie where they
may not. Re-expanding the client's tempered log-posterior at each global mode,

    −log p_c(w) ≈ const + g_kᵀ (w − w*_k) + ½ (w − w*_k)ᵀ Λ_k (w − w*_k),
    g_k = ∇_w [L_c(w) / T + ½ λ_c ‖w‖²] at w*_k,   Λ_k = G(w*_k) / T + λ_c I,

(L_c the summed cross-entropy, G its GGN) is the Gaussian N(ŵ_k, Λ_k⁻¹) with the Gauss–Newton
centre ŵ_k = w*_k − Λ_k⁻¹ g_k. That undamped step extrapolates the quadratic model far beyond where
it holds (measured on LeNet: ‖ŵ − w*‖ ≈ 250 for weights of norm ≈ 10, and the refit predicts at
chance), so the centre takes a Levenberg–Marquardt step instead, damped at per-sample scale as
``fedbens``' ``damping`` is: ŵ_k = w*_k − Λ_{k,d}⁻¹ g_k with Λ_{k,d} the precision of the damped
curvature (``Precision.damped(n, d)``: a Kronecker block (B + n·d·I) ⊗ (A + d·I), any other block
+ n·d on its diagonal), and the component stores that damped curvature with that centre: the
Gaussian N(ŵ_k, Λ_{k,d}⁻¹) then has the silo's gradient at w*_k for every d
(Λ_{k,d} (w*_k − ŵ_k) = g_k), so a fixed point of repeated rounds, where the fused posterior's
gradient vanishes, is a stationary point of the global posterior Σ_c f_c − (C − 1)·prior; the
damping only adds curvature (a trust region around w*_k). ``damping="auto"``
chooses d per mode on the silo, without the server's data: the Levenberg–Marquardt gain ratio
ρ = [f(w*_k) − f(ŵ_k)] / [m(0) − m(ŵ_k − w*_k)] (f the silo's tempered negative log-posterior, m its
quadratic model at w*_k) measures whether the silo's own loss confirms the step the Gaussian
encodes; the smallest d of ``AUTO_DAMPINGS`` with ρ ≥ ``RATIO_FLOOR`` (¼, the textbook trust-region
threshold) is kept, at one forward pass over the silo per d tried; when none passes, the largest is
kept, a warning says so and the component records ``gain_test = "failed"``. The refreshed artifact
has one component per global mode, so the server refits from curvature taken where the fused
posterior lives.

**Trust boundary.** The global's members are the server's choice, and what the silo sends back (a
gradient and curvature at those points) is a function of its data there: a point built to make the
reply reveal training examples (a "binning trap") is far from anything the silo's own posterior
finds plausible. So the silo recaptures only from its own artifact (model, structure, T and λ0 come
from it) and accepts a global only if it holds at most ``MAX_COMPONENTS`` members (``-M``'s cap), each
finite and within the **trust radius** of its own posterior: ``min_m (w − ŵ_m)ᵀ Λ_m (w − ŵ_m) / d ≤ ρ``
over its components (Λ_m the component's posterior precision, d the parameter count; a draw from the
component's Gaussian averages 1). Fused modes of honest servers lie within 0.1–0.6 of every client
on the LeNet demo sets at α = 0.1, points at the scale of the silo's weights but unrelated to them at
2–20, the negated MAP at 9–70; the default ``TRUST_RADIUS`` is 4. The damping must be in
``ranges.REFRESH_DAMPING``. Anything else is refused in one line before any capture. The radius does
not stop every point built to leak: a binning trap at the weights' scale lies at 0.35–0.44
(docs/security.md). Cost for the silo: one gradient pass and one capture per mode, no training; the
message back is one client artifact (the same size as the first).

**A private refresh** (the default, ``RefreshPrivacy``: ``refresh_dp_epsilon``). The radius cannot tell a
trap from an honest mode, so the release itself is made private. At each global member w*_k the silo
releases one quantity: its gradient, each sample's clipped to ``refresh_dp_clip`` in L2 (adding or removing
a sample moves the sum by at most that), plus Gaussian noise ``σ · refresh_dp_clip`` per coordinate
(``local/privacy/``); σ is the smallest whose K releases (K members) compose, by Opacus' RDP accountant, to
(``refresh_dp_epsilon``, ``refresh_dp_delta``; default δ = 1/n). No curvature is taken at w*_k: the component
keeps the curvature of the silo's own component nearest to w*_k (least squared distance in its own
precision) — already in the first artifact, so post-processing — and its centre is the damped step from
w*_k with that curvature and the noisy gradient. ``damping`` auto would choose on the silo's loss (a release
of its own), so a private round takes ``PRIVATE_REFRESH_DAMPING`` then and runs no gain test
(``gain_test = "not run"``). The artifact records the mechanism, its parameters and the (ε, δ) under
``refreshed_at.dp``; refreshing a differentially private artifact is allowed only this way, its ε then
composed with the fit's (their sum). ``refresh_dp_epsilon`` none releases the exact gradient and a new
curvature at the server's points, as described above.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable

import torch

from posterior_fusion import budget, ranges
from posterior_fusion.artifact.reader import load_client, load_global
from posterior_fusion.artifact.schema import MAX_COMPONENTS
from posterior_fusion.artifact.writer import write_client_artifact
from posterior_fusion.curvature.compressed import PLAIN, Compression
from posterior_fusion.data.silo import SiloData, read_silo
from posterior_fusion.errors import ConfigError, IncompatibleArtifactsError
from posterior_fusion.files import output_lock
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.policy import block_policy
from posterior_fusion.local.fit_checks import library_versions
from posterior_fusion.local.fit_config import FitConfig
from posterior_fusion.local.recapture import finish_metadata, prepare
from posterior_fusion.local.refresh_settings import (
    AUTO_DAMPINGS,
    PRIVATE_REFRESH,
    PRIVATE_REFRESH_DAMPING,
    RATIO_FLOOR,
    REFRESH_DAMPING,
    TRUST_RADIUS,
    RefreshPrivacy,
    check_damping,
)
from posterior_fusion.models.members import build_model
from posterior_fusion.posterior import ClientPosterior, Component, GlobalEnsemble, frozen_mapping
from posterior_fusion.settings import declared_default


def own_posterior(source: ClientPosterior) -> list[tuple[torch.Tensor, object]]:
    """``(ŵ_m (d,), Λ_m)`` per component of ``source``, in float64 (converted once for every member tested)."""
    return [(comp.map.double(), comp.curvature.precision(comp.temperature, comp.prior_precision).astype(torch.float64))
            for comp in source.components]


def nearest_own_component(source: ClientPosterior, w: torch.Tensor,
                          posterior: list[tuple[torch.Tensor, object]] | None = None) -> tuple[int, float]:
    """``(m, q)``: the component of ``source`` nearest to ``w`` ``(d,)`` and ``q = min_m (w − ŵ_m)ᵀ Λ_m (w − ŵ_m) / d``
    (Λ_m the component's posterior precision; ``posterior``: :func:`own_posterior` where the caller has it), in
    float64; ``q`` inf for a non-finite ``w`` (then m = 0)."""
    v = w.double()
    if not torch.isfinite(v).all():
        return 0, math.inf
    best, where = math.inf, 0
    for m, (centre, prec) in enumerate(own_posterior(source) if posterior is None else posterior):
        q = float(prec.quadratic_form(v - centre)) / v.numel()
        if q < best:
            best, where = q, m
    return where, best if math.isfinite(best) else math.inf


def distance_from_own_posterior(source: ClientPosterior, w: torch.Tensor,
                                posterior: list[tuple[torch.Tensor, object]] | None = None) -> float:
    """:func:`nearest_own_component`'s distance."""
    return nearest_own_component(source, w, posterior)[1]


def check_refresh_global(source: ClientPosterior, at: GlobalEnsemble, trust_radius: float = TRUST_RADIUS) -> list[int]:
    """The silo's trust boundary (module docstring): ``at`` holds the same model as ``source``, at most
    ``MAX_COMPONENTS`` members, each within ``trust_radius`` of the silo's own posterior; else one
    :class:`IncompatibleArtifactsError` line naming the file. Returns each member's nearest own component."""
    ranges.check("trust radius", trust_radius, ranges.TRUST_RADIUS)
    if at.model_spec != source.model_spec or at.layout != source.layout:
        raise IncompatibleArtifactsError(f"{at.path}: holds a different model than {source.path} "
                                         f"({at.model_spec.to_json()} vs {source.model_spec.to_json()})")
    if len(at.members) > MAX_COMPONENTS:
        raise IncompatibleArtifactsError(f"{at.path}: has {len(at.members)} members; a refresh round recaptures at "
                                         f"most {MAX_COMPONENTS} (the cap of -M)")
    posterior = own_posterior(source)
    nearest = []
    for k, w in enumerate(at.members):
        m, q = nearest_own_component(source, w, posterior)
        nearest.append(m)
        if not q <= trust_radius:
            raise IncompatibleArtifactsError(
                f"{at.path}: member {k} lies at {q:.3g} (squared distance per parameter) from this silo's own "
                f"posterior, beyond the trust radius {trust_radius:g}; refused: a server-chosen point far from it can "
                "make the refreshed artifact reveal training data (a draw from the silo's posterior averages 1)")
    return nearest


def loss_gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> torch.Tensor:
    """∇_w Σ_i CE(f(x_i; w), y_i) over the whole silo, ``(d,)`` float64 (summed batch by batch)."""
    params = [p for p in model.parameters()]
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64, device=x.device)
    model.eval()
    for i in range(0, x.shape[0], batch_size):
        loss = torch.nn.functional.cross_entropy(model(x[i : i + batch_size]), y[i : i + batch_size], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        total += torch.cat([g.reshape(-1) for g in grads]).double()
    return total


def summed_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    """Σ_i CE(f(x_i; w), y_i) over the whole silo, summed in float64 (no gradient)."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, x.shape[0], batch_size):
            total += float(torch.nn.functional.cross_entropy(model(x[i : i + batch_size]), y[i : i + batch_size],
                                                             reduction="sum").double())
    return total


def silo_loss(source: ClientPosterior, x: torch.Tensor, y: torch.Tensor, batch_size: int,
              dtype: torch.dtype) -> Callable[[torch.Tensor], float]:
    """``w (d,) ↦`` the silo's summed cross-entropy at weights w of ``source``'s model (on x's device)."""
    def loss(w: torch.Tensor) -> float:
        return summed_loss(build_model(source.model_spec, w.to(dtype)).to(x.device), x, y, batch_size)
    return loss


def step_ratio(point: torch.Tensor, centre: torch.Tensor, curvature, gradient: torch.Tensor, temperature: float,
               prior_precision: float, loss_at_point: float, loss_at_centre: float,
               prior_mean: torch.Tensor | None = None) -> float:
    """Levenberg–Marquardt gain ratio ρ of the step s = ŵ − w* (``point`` w*, ``centre`` ŵ, ``(d,)``):
    the decrease of the silo's tempered negative log-posterior f(w) = L(w)/T + ½λ‖w‖² (L the summed
    cross-entropy, given at both points) over the decrease its quadratic model predicts,
    −(rᵀs + ½ sᵀ Λ s) with r = g/T + λ w* and Λ = G/T + λ I (undamped). ρ ≈ 1: the Gaussian of the
    refresh round describes the silo's posterior along the step; ρ ≤ 0: the step left that region.
    ``prior_mean`` ``(d,)``: the prior's centre μ0 (a base; ‖w − μ0‖² in f, λ (w* − μ0) in r), default zero."""
    mu = 0.0 if prior_mean is None else prior_mean.double().cpu()
    w, c = point.double().cpu() - mu, centre.double().cpu() - mu  # the prior's coordinates: s is unchanged
    s = c - w
    r = gradient.double().cpu() / temperature + prior_precision * w
    quad = curvature.astype(torch.float64).precision(temperature, prior_precision).quadratic_form(s)
    predicted = -(float(r @ s) + 0.5 * float(quad))
    actual = (loss_at_point - loss_at_centre) / temperature + 0.5 * prior_precision * (float(w @ w) - float(c @ c))
    if predicted <= 0:  # no decrease predicted (a zero step): nothing to confirm
        return 1.0 if actual >= 0 else 0.0
    ratio = actual / predicted
    return ratio if math.isfinite(ratio) else -1e30  # a loss that overflowed at the centre: rejected


def refresh_centre(point: torch.Tensor, curvature, gradient: torch.Tensor, temperature: float,
                   prior_precision: float, n_data: int, damping: float | str,
                   loss: Callable[[torch.Tensor], float],
                   prior_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, float, float]:
    """The refresh round's centre at w* = ``point``: ``(ŵ (d,) float64, the damping used, its ratio ρ)``.
    ``damping`` a number: that Levenberg–Marquardt step; ``"auto"``: the smallest of ``AUTO_DAMPINGS``
    whose ρ (:func:`step_ratio`) reaches ``RATIO_FLOOR`` — the largest step the silo's own loss
    confirms, chosen without the server's data (the largest damping if none does: ρ then says so). ``loss`` maps a
    ``(d,)`` point to the silo's summed cross-entropy (one forward pass per call); ``prior_mean``: the
    prior's centre (default zero)."""
    at_point = loss(point)
    curvature = curvature.astype(torch.float64)  # once: the conversions inside are then no-ops for every d
    tried = AUTO_DAMPINGS if damping == "auto" else (float(damping),)
    for d in tried:
        centre = newton_centre(point, curvature, gradient, temperature, prior_precision, n_data, d, prior_mean)
        ratio = step_ratio(point, centre, curvature, gradient, temperature, prior_precision, at_point, loss(centre),
                           prior_mean)
        if ratio >= RATIO_FLOOR:
            break
    return centre, d, ratio


def newton_centre(point: torch.Tensor, curvature, gradient: torch.Tensor, temperature: float,
                  prior_precision: float, n_data: int = 1, damping: float = 0.0,
                  prior_mean: torch.Tensor | None = None) -> torch.Tensor:
    """ŵ = w* − Λ_d⁻¹ (g/T + λ (w* − μ0)) with Λ_d = damped(G, n, d)/T + λ I (module docstring), float64
    ``(d,)``; ``point`` ``(d,)`` is w*, ``gradient`` ``(d,)`` the summed cross-entropy's g at w*, ``prior_mean``
    μ0 the prior's centre (default zero). ``damping`` 0: the plain Gauss–Newton centre."""
    w = point.double().cpu()
    pull = w if prior_mean is None else w - prior_mean.double().cpu()
    curv = curvature.astype(torch.float64)
    if damping > 0:
        curv = curv.damped(n_data, damping)
    return w - curv.precision(temperature, prior_precision).solve(gradient.cpu() / temperature + prior_precision * pull)


def private_refresh(source: ClientPosterior, x: torch.Tensor, y: torch.Tensor, at: GlobalEnsemble,
                    nearest: list[int], damping: float | str, privacy: RefreshPrivacy, batch: int,
                    log: Callable[[str], None]) -> tuple[dict, list[Component]]:
    """The private refresh round (module docstring): ``(the refreshed_at.dp record, one component per member)``;
    ``nearest``: each member's nearest own component (:func:`check_refresh_global`), whose curvature it keeps."""
    from posterior_fusion.local.privacy import accounting
    from posterior_fusion.local.privacy import training as private_training

    version = accounting.opacus_version()
    n_data = int(source.metadata["n_data"])
    delta = privacy.refresh_dp_delta if privacy.refresh_dp_delta is not None else 1.0 / n_data
    releases = len(at.members)
    sigma = accounting.release_noise(privacy.refresh_dp_epsilon, releases, delta)
    used = PRIVATE_REFRESH_DAMPING if damping == "auto" else float(damping)
    noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)  # fresh per run
    comps = []
    for k, point in enumerate(at.members):
        t0 = time.perf_counter()
        ref = source.components[nearest[k]]
        model = build_model(source.model_spec, point).to(x.device)
        g = private_training.private_gradient(model, x, y, privacy.refresh_dp_clip, sigma, noise, min(batch, 64))
        centre = newton_centre(point, ref.curvature, g, ref.temperature, ref.prior_precision, n_data, used,
                               source.prior_mean)
        stored = ref.curvature.damped(n_data, used) if used > 0 else ref.curvature
        training = {"seed": int(ref.training.get("seed", 0)) + k, "refreshed_at_member": k, "curvature_from": nearest[k],
                    "gradient_norm": float(g.norm()), "newton_step_norm": float((centre - point.double().cpu()).norm()),
                    "damping": used, "gain_test": "not run", "device": x.device.type}
        comps.append(Component(k, centre.to(ref.map.dtype), stored, frozen_mapping(training), ref.temperature,
                               ref.prior_precision))
        log(f"global mode {k + 1}/{releases}: private gradient ({time.perf_counter() - t0:.1f}s), the curvature of "
            f"component {nearest[k] + 1}, damping {used:g}")
    record = {"epsilon": accounting.release_epsilon(sigma, releases, delta), "delta": delta,
              "target_epsilon": privacy.refresh_dp_epsilon, "accountant": "rdp", "releases": releases,
              "mechanism": "Gaussian mechanism on the per-sample-clipped gradient at each global member; the "
                           "curvature is the artifact's own (no new release)",
              "noise_multiplier": sigma, "clip": privacy.refresh_dp_clip, "opacus": version}
    fit_dp = source.metadata.get("dp")
    if isinstance(fit_dp, dict):  # basic composition with the fit's own release
        record["epsilon_with_fit"] = record["epsilon"] + float(fit_dp["epsilon"])
        record["delta_with_fit"] = delta + float(fit_dp["delta"])
    return record, comps


def refresh(source: ClientPosterior, data: SiloData, at: GlobalEnsemble, structure: str | None = None,
            ggn: str | None = None, curvature_batch_size: int | None = None, method: str = "fast",
            log: Callable[[str], None] = print, kfac: str | None = None, device: str = "auto",
            damping: float | str = REFRESH_DAMPING, capture_dtype: str = "float32",
            trust_radius: float = TRUST_RADIUS, privacy: RefreshPrivacy = PRIVATE_REFRESH) -> tuple[dict, list[Component]]:
    """The silo's half of a refresh round at the members of ``at`` (module docstring); returns ``(metadata,
    components)``, one component per member. ``at`` is checked first (:func:`check_refresh_global`,
    ``trust_radius``). Private unless ``privacy`` says otherwise ("A private refresh"): then ``structure`` must be
    the source's (None: the source's) and ``ggn``, ``kfac``, ``capture_dtype`` and ``method`` are not used.
    Without privacy: curvature G(w*_k) of ``structure`` and the silo's gradient at each member, each component
    centred at the damped Gauss–Newton step; SWAG moments and FedPPD students (which belong to the local MAPs)
    are dropped."""
    damping = check_damping(damping)
    privacy.validate()
    structure = source.structure if structure is None else structure
    if privacy.private and structure != source.structure:
        raise ConfigError(f"a private refresh round keeps the artifact's own curvature ({source.structure}); it cannot "
                          f"capture {structure} (`refresh_dp_epsilon` none would, releasing it as it is)")
    nearest = check_refresh_global(source, at, trust_radius)
    prep = prepare(source, data, ggn, kfac, curvature_batch_size, device, private=privacy.private)
    meta = prep.meta
    if privacy.private:
        record, comps = private_refresh(source, prep.x, prep.y, at, nearest, damping, privacy, prep.batch, log)
        used = comps[0].training["damping"]
        meta["refreshed_at"] = {"file_sha256": at.sha256, "method": at.method, "members": len(at.members),
                                "damping": used, "dp": record}
        recipe = {"from": prep.origin["fit_fingerprint"], "structure": structure, "at": at.sha256, "damping": used,
                  "dp": {k: record[k] for k in ("target_epsilon", "delta", "clip")}}
        meta.update(recaptured_from=prep.origin, library_versions=library_versions(),
                    fit_fingerprint=hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest())
        return meta, comps
    comps, policy = [], None
    ref = source.components[0]
    n_data = int(meta["n_data"])
    loss = silo_loss(source, prep.x, prep.y, prep.batch, ref.map.dtype)
    for k, point in enumerate(at.members):
        training = {"seed": int(ref.training.get("seed", 0)) + k, "refreshed_at_member": k}
        model = build_model(source.model_spec, point).to(prep.x.device)
        t0 = time.perf_counter()
        curv, captured_by = capture(structure, model, prep.x, prep.y, prep.batch, prep.ggn, method,
                                    torch.Generator().manual_seed(training["seed"]), log, prep.kfac, capture_dtype)
        if captured_by == "fast":
            policy = dict(block_policy(model, structure, prep.kfac))
        seconds = time.perf_counter() - t0
        training.update(curvature_seconds=round(seconds, 3), capture=captured_by, device=prep.x.device.type)
        g = loss_gradient(model, prep.x, prep.y, prep.batch)
        centre, used, ratio = refresh_centre(point, curv, g, ref.temperature, ref.prior_precision, n_data, damping,
                                             loss, source.prior_mean)
        passed = ratio >= RATIO_FLOOR
        training.update(gradient_norm=float(g.norm()), newton_step_norm=float((centre - point.double().cpu()).norm()),
                        damping=used, step_ratio=ratio, gain_test="passed" if passed else "failed")
        stored = curv.damped(n_data, used) if used > 0 else curv  # the step's own precision (module docstring)
        comps.append(Component(k, centre.to(ref.map.dtype), stored, frozen_mapping(training), ref.temperature,
                               ref.prior_precision))
        log(f"global mode {k + 1}/{len(at.members)}: {structure} curvature {seconds:.1f}s, gradient norm "
            f"{training['gradient_norm']:.3g}, Gauss-Newton step {training['newton_step_norm']:.3g} "
            f"(damping {used:g}, gain ratio {ratio:.2f})")
        if not passed:
            warnings.warn(f"global mode {k + 1}/{len(at.members)}: the silo's loss does not confirm the step at "
                          f"damping {used:g} (gain ratio {ratio:.2f} < {RATIO_FLOOR}); the component keeps it, "
                          "recorded as gain_test = failed", stacklevel=2)
    meta["refreshed_at"] = {"file_sha256": at.sha256, "method": at.method, "members": len(at.members),
                            "damping": damping}
    return finish_metadata(prep, structure, capture_dtype, policy, {"at": at.sha256, "damping": damping}), comps


def refresh_bytes(source: ClientPosterior, at: GlobalEnsemble, n: int, input_size: int, batch: int,
                  private: bool) -> int:
    """What a refresh round holds at its peak, in bytes, estimated before any work: every own component's
    precision in float64 (the trust-radius check), the silo's inputs, and per member either the private
    gradient's per-sample gradients (a batch of at most 64, about four copies of ``(batch, d)`` float32 in
    torch.func) or a capture (the curvature twice, float32 and float64, and the gradient pass)."""
    d = source.layout.dim
    curvature = sum(c.curvature.nbytes for c in source.components)
    own = 2 * curvature + 8 * d * len(source.components)
    work = 16 * min(batch, 64) * d if private else 3 * max(c.curvature.nbytes for c in source.components) + 16 * d
    return own + work + 4 * n * input_size + 8 * d * len(at.members)


def refresh_to_file(source_path: str | os.PathLike, silo_path: str | os.PathLike, at_path: str | os.PathLike,
                    out: str | os.PathLike, structure: str | None = None, ggn: str | None = None,
                    curvature_batch_size: int | None = None, method: str = "fast",
                    max_memory: int | str | None = None, log: Callable[[str], None] = print,
                    kfac: str | None = None, device: str = "auto", compression: Compression = PLAIN,
                    damping: float | str = REFRESH_DAMPING, capture_dtype: str = "float32",
                    trust_radius: float = TRUST_RADIUS, privacy: RefreshPrivacy = PRIVATE_REFRESH) -> dict:
    """What ``pfuse refresh`` does: validate the silo's own artifact, the silo and the global ``at_path``, run
    :func:`refresh`, write ``out`` atomically. Returns the new metadata."""
    compression.validate()
    with output_lock(out, inputs=[source_path, silo_path, at_path]):  # checked before anything is loaded
        source = load_client(source_path, max_memory)
        at = load_global(at_path, max_memory)
        data = read_silo(silo_path, num_classes=source.model_spec.num_classes, max_memory=max_memory)
        default_batch = declared_default(FitConfig, "curvature_batch_size")
        batch = int(curvature_batch_size or source.metadata.get("curvature_batch_size", default_batch) or default_batch)
        need = refresh_bytes(source, at, len(data), math.prod(data.input_shape()), batch, privacy.private)
        budget.require(need, f"the refresh round of {source_path} at the {len(at.members)} members of {at_path}",
                       max_memory)
        meta, comps = refresh(source, data, at, structure, ggn, curvature_batch_size, method, log, kfac, device,
                              damping, capture_dtype, trust_radius, privacy)
        write_client_artifact(out, source.model_spec, source.layout, meta, comps, compression, source.prior_mean)
    return meta
