"""Shared starting points: the same per-mode initialisation on every client."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector

from posterior_fusion import budget
from posterior_fusion.artifact.h5check import file_sha256
from posterior_fusion.artifact.reader import load_global
from posterior_fusion.errors import ConfigError, IncompatibleArtifactsError, PfuseError, shown
from posterior_fusion.files import require_regular_file
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models import ModelSpec


def init_fingerprint(spec: ModelSpec, inits: list[torch.Tensor]) -> str:
    """sha256 of the model spec and the starting points: equal on every client that trains
    component m from the same point for every m (what FedBEns' per-mode fusion needs)."""
    h = hashlib.sha256(spec.to_json().encode())
    for w in inits:
        h.update(w.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def initial_weights(spec: ModelSpec, num_modes: int, init_seed: int) -> list[torch.Tensor]:
    """``num_modes`` flat ``(d,)`` vectors from PyTorch's default initialisers.

    Mode ``m`` is drawn with seed ``init_seed * 1_000_003 + m``, so every client that uses
    the same ``init_seed`` gets the same starting point per mode.
    """
    out = []
    for m in range(num_modes):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed * 1_000_003 + m)
            out.append(parameters_to_vector(spec.build().parameters()).detach().clone())
    return out


def finetune_start(spec: ModelSpec, base: torch.Tensor, setting: str, components: int,
                   init_seed: int = 0) -> tuple[ModelSpec, list[torch.Tensor], torch.Tensor]:
    """What ``fit-local --finetune SETTING`` trains from a base ``(d,)`` of ``spec``'s architecture: ``(the
    fine-tuning spec holding the base, M equal starting points (d_t,), the prior's centre (d_t,))`` — the
    trainable part of the base (LoRA's adapter factors drawn once with ``init_seed``, B = 0: the base's
    function), the prior N(start, σ0² I) centred there."""
    if setting == "all":
        return spec, [base.clone() for _ in range(components)], base
    with torch.device("meta"):
        layout = ParameterLayout.from_model(spec.build())
    if base.shape != (layout.dim,):
        raise IncompatibleArtifactsError(f"the base has {base.numel()} weights, model {spec.name!r} {layout.dim}")
    named = {**(spec.base or {}), **{e.name: t.clone() for e, t in zip(layout.entries, layout.split(base.float()))}}
    tuned = ModelSpec(spec.name, dict(spec.kwargs), spec.provider, setting, named)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed * 1_000_003)
        start = parameters_to_vector(tuned.build().parameters()).detach().clone()
    return tuned, [start.clone() for _ in range(components)], start


def full_base(spec: ModelSpec, weights: torch.Tensor) -> torch.Tensor:
    """A model of ``spec`` with flat ``weights`` as a base for the architecture: ``(d,)`` in the
    architecture's parameter order (a fine-tuning spec's frozen weights put back, LoRA merged)."""
    if spec.finetune == "all":
        return weights.float().clone()
    from torch.nn.utils import vector_to_parameters

    from posterior_fusion.models.finetune import merged_state

    model = spec.build()
    vector_to_parameters(weights.float().clone(), model.parameters())
    state = merged_state(model)
    with torch.device("meta"):
        names = [n for n, _ in ModelSpec(spec.name, dict(spec.kwargs), spec.provider).build().named_parameters()]
    return torch.cat([state[n].reshape(-1).float() for n in names])


def _checked_statistics(path: Path, spec: ModelSpec, wanted: dict[str, tuple[int, ...]],
                        found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BatchNorm model's running statistics as a base holds them (``wanted``: name → shape): all of them,
    finite, variances >= 0; one line naming the file otherwise."""
    missing = [n for n in wanted if n not in found]
    if missing:
        raise IncompatibleArtifactsError(f"{path}: model {spec.name!r} has BatchNorm; the base holds no "
                                         f"{', '.join(shown(n, 40) for n in missing[:3])} (its running statistics, "
                                         "which stay frozen at the base's)")
    bad = next((n for n, t in found.items() if tuple(t.shape) != wanted[n] or not torch.isfinite(t).all()
                or (n.endswith("running_var") and bool((t < 0).any()))), None)
    if bad is not None:
        raise IncompatibleArtifactsError(f"{path}: tensor {shown(bad, 40)} is not a finite statistic of shape "
                                         f"{wanted[bad]} (a variance >= 0)")
    return found


def write_base(model: torch.nn.Module, path: str | os.PathLike) -> str:
    """Write a model's parameters, by name, as a ``.safetensors`` base for ``pfuse init --base`` (atomically; tensors
    only, nothing executed on load). A stock ``nn.MultiheadAttention``'s packed projections are written as they are
    (the reader splits them).

    Args:
        model: the pretrained network (``named_parameters()`` are written).
        path: the ``.safetensors`` file to write.

    Returns:
        The file's SHA-256 (hex), the base's name everywhere downstream.
    """
    from safetensors.torch import save_file

    from posterior_fusion.files import check_output, write_atomically

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ConfigError(f"{path}: a base is written as a .safetensors file")
    check_output(path)
    tensors = {name: p.detach().cpu().contiguous().clone() for name, p in model.named_parameters()}
    tensors.update({name: b.detach().cpu().contiguous().clone() for name, b in model.named_buffers()
                    if name.endswith(("running_mean", "running_var"))})  # BatchNorm's statistics
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp)))
    return file_sha256(path)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_base(spec: ModelSpec, path: str | os.PathLike,
              max_memory: int | str | None = None) -> tuple[ModelSpec, torch.Tensor, str]:
    """A pretrained base for ``spec``: ``(spec holding the base's BatchNorm statistics where the model has
    BatchNorm — they stay frozen at the base's —, w (d,) float32 in the model's parameter order, the file's
    SHA-256)``.

    ``path``: a ``.safetensors`` file (the ``safetensors`` format: tensors only, nothing executed on load) holding exactly the model's
    parameters by name (``model.named_parameters()``), each of its shape, in a float type, plus a BatchNorm
    model's running statistics; or one of the project's global artifacts of the same model (its first member:
    a fused model becomes the next base). Header, names, shapes and types are checked before any tensor is
    read, the bytes against ``max_memory``; values must be finite. One line naming the file otherwise. The
    file is opened once."""
    from posterior_fusion.models.finetune import statistics_names

    path = Path(path)
    require_regular_file(path)
    sha = file_sha256(path)
    with torch.device("meta"):
        model = spec.build()
    held = dict(statistics_names(model))  # a BatchNorm model's running statistics: name → shape

    def holding(found: dict[str, torch.Tensor]) -> ModelSpec:
        return spec.with_base(_checked_statistics(path, spec, held, found)) if held else spec

    if path.suffix != ".safetensors":
        base = load_global(path, max_memory)
        arch = ModelSpec(base.model_spec.name, dict(base.model_spec.kwargs), base.model_spec.provider)
        if arch != spec:
            raise IncompatibleArtifactsError(f"{path}: holds {base.model_spec.to_json()}, not {spec.to_json()}")
        frozen = base.model_spec.base or {}
        return holding({n: frozen[n] for n in held if n in frozen}), full_base(base.model_spec, base.members[0]), sha
    from safetensors import safe_open

    from posterior_fusion.models.attention import packed_names

    wanted = {name: tuple(p.shape) for name, p in model.named_parameters()}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            # a stock nn.MultiheadAttention's packed in_proj tensors stand for its q / k / v projections
            packed = {n: src for n, src in packed_names(model).items() if n not in names and src[0] in names}
            covered = (set(wanted) - set(packed)) | {src for src, _ in packed.values()}
            statistics = set(held) | {n.rsplit(".", 1)[0] + ".num_batches_tracked" for n in held}
            missing, extra = sorted(covered - names), sorted(names - covered - statistics)
            if missing or extra:
                raise IncompatibleArtifactsError(
                    f"{path}: its tensors do not match {spec.name}'s parameters (missing "
                    f"{', '.join(shown(n, 40) for n in missing[:3]) or 'none'}; not parameters "
                    f"{', '.join(shown(n, 40) for n in extra[:3]) or 'none'})")
            total = 0
            for name, shape in wanted.items():
                source = packed[name][0] if name in packed else name
                need = (3 * shape[0], *shape[1:]) if name in packed else shape
                piece = f.get_slice(source)
                if tuple(piece.get_shape()) != need or piece.get_dtype() not in SAFETENSORS_DTYPES:
                    raise IncompatibleArtifactsError(
                        f"{path}: tensor {shown(source, 40)} is {piece.get_dtype()} {tuple(piece.get_shape())}; the "
                        f"model needs a float tensor of shape {need}")
                total += 4 * math.prod(shape)
            budget.require(2 * total, f"reading {path}", max_memory)
            tensors = {name: (f.get_tensor(packed[name][0]).float().chunk(3)[packed[name][1]] if name in packed
                              else f.get_tensor(name).float()) for name in wanted}
            found = {n: f.get_tensor(n).float() for n in held if n in names}
    except PfuseError:
        raise
    except Exception as exc:  # noqa: BLE001 - the parser's refusals (SafetensorError derives from Exception only)
        raise IncompatibleArtifactsError(f"{path}: not a readable safetensors file ({shown(str(exc), 120)})") from None
    bad = next((name for name, t in tensors.items() if not torch.isfinite(t).all()), None)
    if bad is not None:
        raise IncompatibleArtifactsError(f"{path}: tensor {shown(bad, 40)} holds NaN or Inf")
    return holding(found), torch.cat([tensors[name].reshape(-1) for name, _ in model.named_parameters()]), sha
