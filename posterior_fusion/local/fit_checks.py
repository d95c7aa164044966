"""What a fit records and checks before any training: the client metadata and its fingerprint, the capture's
probe, the parameters left to the prior or numerically zero, a BatchNorm fit's and the component count's
checks, HBFL's local-model teacher."""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import asdict, replace
from importlib.metadata import PackageNotFoundError, version

import torch

from posterior_fusion import ranges
from posterior_fusion.data.silo import SiloData
from posterior_fusion.errors import (
    CaptureNotApplicableError,
    ConfigError,
    ModelSpecError,
    PfuseError,
)
from posterior_fusion.local.capture import capture
from posterior_fusion.local.capture.policy import block_policy
from posterior_fusion.local.fit_config import FitConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.batchnorm import batch_norms, check_foldable


def library_versions() -> dict[str, str]:
    out = {}
    for pkg in ("posterior-fusion", "torch", "laplace-torch", "curvlinops-for-pytorch", "asdfghjkl", "h5py", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def fit_metadata(spec: ModelSpec, data: SiloData, inits: list[torch.Tensor], cfg: FitConfig,
                 prior_mean: torch.Tensor | None = None) -> dict:
    """Client metadata, including ``fit_fingerprint``: a hash of everything that determines the result
    (``prior_mean`` ``(d,)``: the prior's centre when it is a base, not zero)."""
    cfg.validate()
    n = len(data)
    cfg = cfg.resolved(n)
    h = hashlib.sha256()
    h.update(spec.to_json().encode())
    # ``capture`` (fast or laplace-torch) changes the curvature only at rounding level (tested to
    # 1e-5), like a thread count: it is recorded per component, not part of the fingerprint.
    h.update(json.dumps(cfg.fingerprint_dict(), sort_keys=True).encode())
    h.update(data.sha256().encode())
    h.update(data.input_transform.to_json().encode())
    for w in inits:
        h.update(w.detach().cpu().float().numpy().tobytes())
    if prior_mean is not None:
        h.update(b"prior_mean" + prior_mean.detach().cpu().float().numpy().tobytes())
    return {
        "n_data": n, "class_counts": data.class_counts(), "num_classes": data.num_classes,
        "input_shape": list(data.input_shape()),
        "dataset": data.dataset, "data_sha256": data.sha256(), "input_transform": data.input_transform.to_dict(),
        "temperature": cfg.temperature, "prior_precision": cfg.prior_precision, "structure": cfg.structure,
        "train_seed": cfg.train_seed, "curvature_batch_size": cfg.curvature_batch_size, "ggn": cfg.ggn,
        **({"kfac": cfg.kfac} if cfg.structure == "kron" else {}),
        **({"capture_dtype": cfg.capture_dtype} if cfg.capture_dtype != "float32" else {}),
        **({"compress": cfg.compress} if cfg.compress > 0 else {}),  # the file's own: write_client_artifact
        "train": asdict(cfg.train), "library_versions": library_versions(), "fit_fingerprint": h.hexdigest(),
        **({"ppd": asdict(cfg.ppd)} if cfg.ppd is not None else {}),
        # HBFL: the local architecture stays in the silo; only how it was used is recorded
        **({"hbfl_local_model": {"weight": cfg.local_model.weight, "epochs": cfg.local_model.epochs or cfg.train.epochs}}
           if cfg.local_model is not None else {}),
        **({"class_names": list(data.class_names)} if data.class_names else {}),
    }


def local_model_teacher(cfg: FitConfig, x: torch.Tensor, y: torch.Tensor, num_classes: int, log=print,
                    dp_plan=None, noise: torch.Generator | None = None) -> torch.Tensor:
    """HBFL's heterogeneous client: train the silo's local model (same SGD settings, its own
    epochs) and return its probabilities on the silo ``(n, classes)`` for distillation. Under ``dp``
    (``dp_plan``, its pass "local model") through DP-SGD with the plan's noise, drawn from ``noise``."""
    spec = ModelSpec(cfg.local_model.model, dict(cfg.local_model.model_kwargs))
    if spec.num_classes != num_classes:
        raise ConfigError(f"`local_model` outputs {spec.num_classes} classes, the shared model {num_classes}")
    spec.check_input(tuple(x.shape[1:]), "the silo")
    model = spec.build().to(x.device)
    train = replace(cfg.train, epochs=local_model_epochs(cfg), swag=False)
    seed = cfg.train_seed * 1_000_003 + 999_983
    torch.manual_seed(seed)
    if dp_plan is not None:
        from posterior_fusion.local.privacy import training as private_training

        private_training.private_train(model, x, y, train, cfg.dp, dp_plan, train.weight_decay,
                         int.from_bytes(os.urandom(8), "little") >> 1, noise,
                         sample_rate=dp_plan.pass_of("local model").sample_rate)
        log("local model: trained under DP-SGD (kept in the silo)")
    else:
        res = train_map(model, x, y, train, seed=seed, desc="local model")
        log(f"local model: loss {res.final_loss:.4f} acc {res.final_accuracy:.3f} (kept in the silo)")
    model.eval()
    with torch.no_grad():
        return torch.cat([torch.softmax(model(x[i : i + 1024]), -1) for i in range(0, x.shape[0], 1024)])  # on x's device


def local_model_epochs(cfg: FitConfig) -> int:
    """The local model's epochs: ``local_model_epochs``, else the shared model's."""
    return cfg.local_model.epochs or cfg.train.epochs


def prior_only(model: torch.nn.Module, structure: str, private: bool = False) -> str:
    """The parameters the fast capture leaves to the prior, per layer type with parameter counts and names
    (``"56 parameters of nn.Embedding (pos.weight)"``), or "" when every parameter has curvature."""
    sizes = dict(model.named_parameters())
    owners = {f"{m}.{p}" if m else p: type(module).__name__ for m, module in model.named_modules()
              for p, _ in module.named_parameters(recurse=False)}
    groups: dict[str, list[str]] = {}
    for name, kind in block_policy(model, structure):
        if kind == "prior" or (private and kind == "residual"):  # a private capture clips layer rules only
            groups.setdefault(owners.get(name, "?"), []).append(name)
    return "; ".join(f"{sum(sizes[n].numel() for n in names):,} parameters of nn.{kind} ({', '.join(names[:4])}"
                     f"{', …' if len(names) > 4 else ''})" for kind, names in groups.items())


def vanishing_blocks(model: torch.nn.Module, curvature, structure: str, kfac: str) -> list[str]:
    """The trained parameters whose stored kron block is numerically zero (its mean diagonal entry at most 1e-12
    of the largest block's): the prior alone in effect, though the artifact lists curvature for them."""
    if structure != "kron" or len(curvature.blocks) != len(list(model.parameters())):
        return []
    means = [float(b.diagonal().double().mean()) for b in curvature.blocks]  # per parameter
    top = max(means, default=0.0)
    return [name for (name, kind), mean in zip(block_policy(model, structure, kfac), means)
            if kind != "prior" and top > 0 and mean <= 1e-12 * top]


def probe_capture(spec: ModelSpec, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: FitConfig) -> None:
    """The capture run once on two samples of the untrained model, before any training: a model the
    capture cannot take (laplace-torch refuses layers it does not know, e.g. ``nn.MultiheadAttention``
    under K-FAC) is refused in one line now, not after hours of training."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the probe's own warnings repeat in the real capture
            capture(cfg.structure, model, x, y, 2, cfg.ggn, cfg.capture, torch.Generator().manual_seed(0),
                    lambda m: None, cfg.kfac, cfg.capture_dtype)
    except CaptureNotApplicableError as exc:
        raise ModelSpecError(f"model {spec.name!r}: {exc}; nothing was trained") from None
    except PfuseError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of a library's capture is the model's, said in one line
        why = str(exc).strip().splitlines()[0][:200].rstrip(".") if str(exc).strip() else type(exc).__name__
        raise ModelSpecError(f"model {spec.name!r}: the {cfg.structure} capture ({cfg.capture}) fails on it: {why}; "
                             "nothing was trained "
                             "(docs/methods.md, layer policy: use layers it supports, or another structure)") from None


COST_PROBE = 16          # inputs the capture-cost estimate times each structure on
COST_WARN_SECONDS = 120  # an estimated capture above this many seconds in all ...
COST_WARN_RATIO = 5.0    # ... and this many times K-FAC's warns before training


def capture_seconds(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, structure: str, cfg: FitConfig) -> float:
    """Wall seconds of the capture of ``structure`` on the inputs ``x`` ``(b, …)`` (one timed run)."""
    start = time.perf_counter()
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):  # the fit's random stream is left as it was
        warnings.simplefilter("ignore")
        capture(structure, model, x, y, len(x), cfg.ggn, cfg.capture, torch.Generator().manual_seed(0), lambda m: None,
                cfg.kfac, cfg.capture_dtype)
    return time.perf_counter() - start


def capture_cost_warning(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: FitConfig, n: int,
                         components: int) -> str | None:
    """Before training, for the diag and diag+full structures: the capture timed on :data:`COST_PROBE` inputs
    beside K-FAC's on the same inputs and scaled to ``n`` inputs × ``components``; the warning's text where it
    exceeds :data:`COST_WARN_SECONDS` and :data:`COST_WARN_RATIO` × K-FAC's, else None."""
    if cfg.structure == "kron" or len(x) < 2:
        return None
    xb, yb = x[:COST_PROBE], y[:COST_PROBE]
    own = capture_seconds(model, xb, yb, cfg.structure, cfg)
    kron = capture_seconds(model, xb, yb, "kron", cfg)
    total = own / len(xb) * n * components
    ratio = own / max(kron, 1e-9)
    if total <= COST_WARN_SECONDS or ratio <= COST_WARN_RATIO:
        return None
    return (f"the {cfg.structure} capture will take about {total / 60:.0f} min for {components} component(s) of {n} "
            f"inputs, {ratio:.0f}x what K-FAC takes on this model (timed on {len(xb)} inputs before training; "
            "`structure` kron is the cheaper capture)")


def check_batchnorm_fit(spec: ModelSpec, probe: torch.nn.Module, cfg: FitConfig) -> None:
    """A BatchNorm model trained from random starting points, refused in one line before training where its
    statistics cannot be folded: ``batchnorm`` refuse, a layer without affine parameters, or a release that
    would need the statistics of every iterate (SWAG moments) or a private estimate of them (``dp``)."""
    kinds = sorted({type(m).__name__.removeprefix("Frozen") for _, m in batch_norms(probe)})
    where = f"model {spec.name!r} has {', '.join(kinds)}"
    if cfg.batchnorm == "refuse":
        raise ModelSpecError(f"{where} and `batchnorm` is refuse: use GroupNorm or LayerNorm (resnet20: `norm: "
                             "group`), fine-tune a pretrained base (its statistics stay frozen), or `batchnorm` fold")
    check_foldable(probe, where)
    if cfg.train.swag:
        raise ModelSpecError(f"{where}, trained from random starting points: SWAG moments would need each "
                             "iterate's statistics folded in; fit without `swag` (or fine-tune a base)")
    if cfg.dp is not None:
        raise ModelSpecError(f"{where}: BatchNorm mixes the samples of a batch, so per-sample clipping (`dp`) does "
                             "not bound one sample's effect; use GroupNorm or LayerNorm")


def check_component_count(count: int, source: str | os.PathLike | None = None) -> None:
    """M within ``ranges.COMPONENTS`` (the artifact format's cap), checked before any training: an init file
    with more starting points than a client artifact may hold is refused naming it."""
    lo, hi = ranges.COMPONENTS
    if not lo <= count <= hi:
        where = f"{source}: holds {count} starting points" if source else f"{count} components asked for"
        raise ConfigError(f"{where}; a client artifact holds {lo} to {hi} (-M's range)")
