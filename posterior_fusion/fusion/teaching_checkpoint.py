"""An interrupted distillation resumes where it stopped, to the same result.

Every tenth of the schedule :func:`~posterior_fusion.fusion.teaching.teach` saves what the remaining steps depend
on — the student's state (parameters and buffers), the moving average of its weights, Adam's moments, both random
streams (the recipe's generator and torch's own, which dropout draws from) and the held-out history — as one
safetensors file written atomically (a kill mid-write leaves the previous checkpoint). A checkpoint carries a
fingerprint of the recipe, the student's spec, the teachers' weights and the inputs: one of any other
distillation is never resumed (it is replaced). Data-free runs keep their synthesised inputs in it too, so a
resumed run does not synthesise them again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from posterior_fusion.files import write_atomically

FORMAT = "pfuse-teaching-checkpoint-1"


def fingerprint(*parts: object) -> str:
    """SHA-256 (hex) over ``parts``: tensors by their bytes, anything else by its JSON."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            h.update(str((part.dtype, tuple(part.shape))).encode())
            h.update(part.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(json.dumps(part, sort_keys=True, default=str).encode())
    return h.hexdigest()


def save(path: str | os.PathLike, key: str, step: int, model: nn.Module, opt: torch.optim.Adam,
         average: torch.Tensor, gen: torch.Generator, history: list[dict], inputs: torch.Tensor | None = None,
         synthesis: dict | None = None) -> None:
    """Write the state after ``step`` steps (module doc) to ``path``; ``key``: the run's :func:`fingerprint`;
    ``inputs``, ``synthesis``: a data-free run's synthetic inputs and their record."""
    tensors = {f"model.{name}": t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        for name, t in opt.state.get(p, {}).items():
            tensors[f"adam.{i}.{name}"] = t.detach().clone().contiguous().reshape(t.shape)
    tensors.update(average=average.detach().clone().contiguous(), generator=gen.get_state(),
                   torch_rng=torch.get_rng_state())
    if inputs is not None:
        tensors["inputs"] = inputs.detach().contiguous()
    meta = {"format": FORMAT, "key": key, "step": str(step), "history": json.dumps(history),
            "synthesis": json.dumps(synthesis or {})}
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def metadata(path: str | os.PathLike) -> dict[str, str]:
    """A checkpoint's text fields (``step``, ``history``, ``synthesis``…)."""
    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def saved_inputs(path: str | os.PathLike, key: str) -> torch.Tensor | None:
    """The synthesised inputs a checkpoint of run ``key`` keeps (None: no such checkpoint or none kept)."""
    if not _matches(path, key):
        return None
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("inputs") if "inputs" in f.keys() else None


def restore(path: str | os.PathLike, key: str, model: nn.Module, opt: torch.optim.Adam,
            gen: torch.Generator) -> tuple[int, torch.Tensor, list[dict]] | None:
    """Load a checkpoint of run ``key`` into ``model``, ``opt`` and ``gen`` (and torch's random stream): ``(steps
    done, the moving average, the history)``; None where ``path`` holds none of this run."""
    if not _matches(path, key):
        return None
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        state = {k[len("model."):]: f.get_tensor(k) for k in f.keys() if k.startswith("model.")}
        model.load_state_dict(state, strict=True)
        for i, p in enumerate(model.parameters()):
            moments = {k.split(".", 2)[2]: f.get_tensor(k) for k in f.keys() if k.startswith(f"adam.{i}.")}
            if moments:
                opt.state[p] = moments
        gen.set_state(f.get_tensor("generator"))
        torch.set_rng_state(f.get_tensor("torch_rng"))
        return int(meta["step"]), f.get_tensor("average"), json.loads(meta["history"])


def _matches(path: str | os.PathLike, key: str) -> bool:
    if not Path(path).is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - an unreadable checkpoint is one of no run: it is replaced
        return False
    return meta.get("format") == FORMAT and meta.get("key") == key
