"""What a silo fine-tunes of a shared pretrained base (``fit-local --finetune``): the model a fine-tuning
spec builds has the trainable parameters as its only parameters; every other weight of the base is a
frozen, non-persistent buffer holding the base's value. So the flat parameter vector, the layout, the
curvature (subnetwork Laplace: the GGN over the trainable parameters, its blocks those of the full
model's GGN), every fusion method and every predictive work on the trainable subset unchanged, and the
frozen weights are bit-identical to the base's in every model built from the spec.

Settings (one string, recorded in the model spec as ``finetune``):
- ``all``: every parameter (the base's architecture as it is);
- ``head``: the last module that holds parameters (the classifier), ``last:K``: the last K such modules;
- ``lora:R``: the head (the last module with parameters) is trained as it is — a silo may hold classes the
  base never saw — and every other ``nn.Linear`` / ``nn.Conv2d`` keeps the base's weight and bias frozen and
  adds a rank-R adapter ``ΔW = B A`` (two layers: ``A`` a Linear ``in → R`` or a Conv2d with the layer's kernel,
  stride, padding and dilation to R channels, ``B`` a Linear ``R → out`` or a 1×1 Conv2d, no biases; ``B``
  starts at zero, so the model starts at the base); the adapters' factors are ordinary layers to the
  capture (K-FAC over each adapter's two factors, as Laplace-LoRA does). Every other parameter is frozen.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from posterior_fusion.choices import FINETUNE_RE
from posterior_fusion.errors import ModelSpecError, shown

FINETUNES = ("all", "head", "last:K", "lora:R")  # the forms, for help texts


def check_finetune(setting: str) -> str:
    """``setting`` if it is one of :data:`FINETUNES`' forms, else one :class:`ModelSpecError` line."""
    if not isinstance(setting, str) or not FINETUNE_RE.fullmatch(setting):
        raise ModelSpecError(f"finetune must be all, head, last:K or lora:R (K, R in 1..9999), got {shown(setting, 40)}")
    return setting


def parameter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module that holds parameters of its own, in ``model.modules()`` order."""
    return [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def _freeze(module: nn.Module, base: Mapping[str, torch.Tensor] | None, prefix: str) -> None:
    """Turn ``module``'s own parameters into non-persistent buffers holding the base's values."""
    for pname, p in list(module.named_parameters(recurse=False)):
        value = base.get(f"{prefix}{pname}") if base is not None else None
        value = p.detach().clone() if value is None else value.detach().to(p.dtype).clone().reshape(p.shape)
        delattr(module, pname)
        module.register_buffer(pname, value, persistent=False)


class LoRALinear(nn.Module):
    """``y = x Wᵀ + b + B(A(x))`` with ``W``, ``b`` frozen buffers (the base's) and ``A``, ``B`` the adapter."""

    def __init__(self, layer: nn.Linear, rank: int) -> None:
        super().__init__()
        self.register_buffer("weight", layer.weight.detach().clone(), persistent=False)
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().clone(), persistent=False)
        self.lora_A = nn.Linear(layer.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, layer.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x))


class LoRAConv2d(nn.Module):
    """A Conv2d with its weight and bias frozen plus ``B(A(x))``: ``A`` the layer's geometry to R channels,
    ``B`` a 1×1 convolution from R channels."""

    def __init__(self, layer: nn.Conv2d, rank: int) -> None:
        super().__init__()
        self.register_buffer("weight", layer.weight.detach().clone(), persistent=False)
        self.register_buffer("bias", None if layer.bias is None else layer.bias.detach().clone(), persistent=False)
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation
        self.lora_A = nn.Conv2d(layer.in_channels, rank, layer.kernel_size, stride=layer.stride, padding=layer.padding,
                                dilation=layer.dilation, bias=False)
        self.lora_B = nn.Conv2d(rank, layer.out_channels, 1, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
        return out + self.lora_B(self.lora_A(x))


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)
STATISTICS = ("running_mean", "running_var")  # a BatchNorm's statistics, frozen at the base's


class FrozenBatchNorm1d(nn.BatchNorm1d):
    """A BatchNorm1d that always normalises with its stored statistics (evaluation mode, whatever ``train``
    asks): the statistics are the base's, frozen, identical in every silo and in the fused model."""

    def train(self, mode: bool = True) -> FrozenBatchNorm1d:
        return super().train(False)


class FrozenBatchNorm2d(nn.BatchNorm2d):
    """:class:`FrozenBatchNorm1d` for images."""

    def train(self, mode: bool = True) -> FrozenBatchNorm2d:
        return super().train(False)


def freeze_statistics(model: nn.Module, base: Mapping[str, torch.Tensor] | None) -> None:
    """Every BatchNorm of ``model`` in evaluation mode for good, its running statistics non-persistent
    buffers holding ``base``'s (by name, e.g. ``blocks.0.n1.running_mean``; None: its own, for shapes),
    its batch counter dropped."""
    for name, module in model.named_modules():
        if not isinstance(module, BATCH_NORMS):
            continue
        prefix = f"{name}." if name else ""
        for stat in STATISTICS:
            value = base.get(f"{prefix}{stat}") if base is not None else None
            own = getattr(module, stat)
            value = own.detach().clone() if value is None else value.detach().to(own.dtype).clone().reshape(own.shape)
            delattr(module, stat)
            module.register_buffer(stat, value, persistent=False)
        if hasattr(module, "num_batches_tracked"):
            delattr(module, "num_batches_tracked")
            module.register_buffer("num_batches_tracked", None, persistent=False)
        module.__class__ = FrozenBatchNorm1d if isinstance(module, nn.BatchNorm1d) else FrozenBatchNorm2d
        module.train(False)


def statistics_names(architecture: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every BatchNorm's running statistics, in module order: frozen at the base's."""
    out = []
    for name, module in architecture.named_modules():
        if isinstance(module, BATCH_NORMS) and module.track_running_stats:
            prefix = f"{name}." if name else ""
            out += [(f"{prefix}{stat}", tuple(getattr(module, stat).shape)) for stat in STATISTICS]
    return out


def apply_finetune(model: nn.Module, setting: str, base: Mapping[str, torch.Tensor] | None) -> nn.Module:
    """``model`` (the base's architecture) as ``setting`` fine-tunes it, in place: frozen weights become
    buffers holding ``base``'s values (by the architecture's parameter names; None: the model's own, for
    shapes on the meta device), trainable ones start at ``base``'s values (adapters as the class says);
    every BatchNorm's statistics are frozen at the base's (:func:`freeze_statistics`)."""
    check_finetune(setting)
    freeze_statistics(model, base)
    if setting == "all":
        if base is not None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in base:
                        p.copy_(base[name].reshape(p.shape))
        return model
    modules = parameter_modules(model)
    if setting.startswith("lora:"):
        rank = int(setting.split(":")[1])
        if base is not None:
            apply_finetune(model, "all", base)  # the base's values first; the adapters then copy them
        for name, module in modules[:-1]:  # the head stays trainable
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"):
                    raise ModelSpecError(f"finetune {setting}: convolution {name} uses groups or a padding mode")
                sides = ((module.in_features, module.out_features) if isinstance(module, nn.Linear)
                         else (module.in_channels * math.prod(module.kernel_size), module.out_channels))
                if rank > min(sides):  # an adapter wider than its layer adds weights, not a low rank
                    raise ModelSpecError(f"finetune {setting}: rank {rank} exceeds layer {name}'s sides {sides} "
                                         f"(at most {min(sides)})")
                wrapped = LoRALinear(module, rank) if isinstance(module, nn.Linear) else LoRAConv2d(module, rank)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, wrapped)
            else:
                _freeze(module, base, f"{name}." if name else "")
        return model
    keep = 1 if setting == "head" else int(setting.split(":")[1])
    if keep > len(modules):
        raise ModelSpecError(f"finetune {setting}: the model has only {len(modules)} modules with parameters")
    if base is not None:
        apply_finetune(model, "all", base)
    for name, module in modules[: len(modules) - keep]:
        _freeze(module, base, f"{name}." if name else "")
    return model


def frozen_names(architecture: nn.Module, setting: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of the base's parameters that ``setting`` freezes, in the architecture's parameter
    order (a ``lora:R`` setting every one but the head's), then every BatchNorm's running statistics
    (:func:`statistics_names`; frozen under every setting, ``all`` included): what an artifact of a fine-tuning spec stores once as
    ``/frozen``."""
    check_finetune(setting)
    stats = statistics_names(architecture)
    if setting == "all":
        return stats
    named = [(n, tuple(p.shape)) for n, p in architecture.named_parameters()]
    modules = parameter_modules(architecture)
    keep = 1 if setting in ("head",) or setting.startswith("lora:") else int(setting.split(":")[1])
    trainable = {f"{n}.{p}" if n else p for n, m in modules[len(modules) - keep:] for p, _ in m.named_parameters(recurse=False)}
    return [(n, s) for n, s in named if n not in trainable] + stats


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base architecture's weights of a fine-tuning model, by the architecture's parameter names:
    trained and frozen weights as they are, a LoRA layer's weight merged, ``W + B A`` (what a fused model
    hands on as the next base)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, (LoRALinear, LoRAConv2d)):
            A, B = module.lora_A.weight.detach(), module.lora_B.weight.detach()
            delta = B @ A if isinstance(module, LoRALinear) else torch.einsum("or,rikl->oikl", B[:, :, 0, 0], A)
            out[f"{prefix}weight"] = module.weight.detach() + delta
            if module.bias is not None:
                out[f"{prefix}bias"] = module.bias.detach()
            continue
        if name.endswith(("lora_A", "lora_B")):
            continue
        for pname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if t is not None:
                out[f"{prefix}{pname}"] = t.detach()
    return out
