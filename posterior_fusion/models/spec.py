"""A model's JSON spec ``{"name": ..., "kwargs": {...}}`` (:class:`ModelSpec`): nothing is ever unpickled. A spec
names a registered builder (:mod:`.model_registry`) and keyword arguments, checked against the builder's declared
arguments and types, and an artifact records which package provided its model so the server can say what to
install.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from posterior_fusion import budget
from posterior_fusion.errors import ModelSpecError
from posterior_fusion.models.model_registry import resolve_model


def non_parameter_state(model: nn.Module) -> str | None:
    """Why ``model`` cannot be fitted into an artifact (None when it can): state outside its
    parameters — persistent buffers such as BatchNorm's running statistics — would not travel in
    the artifact, which stores parameters only, so every reader would predict with the freshly built
    buffers: a silently wrong model. The policy is documented in ``docs/methods.md`` ("Layer policy")."""
    for mname, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        state = [b for b, t in module.named_buffers(recurse=False) if b not in skip and t is not None]
        if state:
            where = f"layer {mname!r} ({type(module).__name__})" if mname else type(module).__name__
            return (f"{where} keeps state outside its parameters ({', '.join(state[:3])}); an artifact stores "
                    "parameters only, so its readers would predict with fresh statistics — use GroupNorm or "
                    "LayerNorm (resnet20: `norm: group`), a model without BatchNorm, or fine-tune a pretrained base "
                    "(pfuse init from a base file), whose BatchNorm statistics stay frozen")
    return None


MAX_SPEC_INT = 1 << 20
MAX_PARAMETERS = 50_000_000   # the artifact format's cap too
TRAINING_BYTES_PER_PARAMETER = 16  # float32 weights, gradients, momentum and one working copy


@dataclass(frozen=True)
class ModelSpec:
    """A model named in :data:`MODEL_REGISTRY` with validated keyword arguments; ``finetune`` what of it a
    silo fine-tunes (:mod:`.finetune`; not ``all``: the frozen weights come from ``base``, the pretrained
    weights by the architecture's parameter names — not part of the spec's JSON, readers take them from
    the artifact's ``/frozen``)."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    provider: str | None = field(default=None, compare=False)  # "package==version" of a plugin model
    finetune: str = "all"
    base: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or len(self.name) > 128:
            raise ModelSpecError("model name must be a short string")
        from posterior_fusion.models.finetune import check_finetune

        check_finetune(self.finetune)
        builder, allowed, provider = resolve_model(self.name, self.provider)
        object.__setattr__(self, "provider", provider)
        if not isinstance(self.kwargs, dict):
            raise ModelSpecError("model kwargs must be a JSON object")
        for key, value in self.kwargs.items():
            if key not in allowed:
                raise ModelSpecError(f"model {self.name!r} takes no argument {key!r}; allowed: {', '.join(allowed)}")
            expected = allowed[key]
            if expected is list:
                ok = (isinstance(value, list) and len(value) <= 64
                      and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SPEC_INT for v in value))
                if not ok:
                    raise ModelSpecError(f"model argument {key!r} must be a list of at most 64 positive integers")
                continue
            ok = isinstance(value, bool) if expected is bool else (
                isinstance(value, expected) and not isinstance(value, bool))
            if not ok:
                raise ModelSpecError(f"model argument {key!r} must be {expected.__name__}, got {value!r}")
            if expected is int and not (1 <= value <= MAX_SPEC_INT):
                raise ModelSpecError(f"model argument {key!r}={value} is out of range [1, {MAX_SPEC_INT}]")
            if expected is str and len(value) > 64:
                raise ModelSpecError(f"model argument {key!r} is too long")

    def _construct(self) -> nn.Module:
        """The builder's model, held to the contract: built without raising, an ``nn.Module`` with parameters
        (one :class:`ModelSpecError` line naming the model and its provider otherwise)."""
        builder = resolve_model(self.name, self.provider)[0]
        who = f"model {self.name!r}" + (f" (plugin {self.provider})" if self.provider else "")
        try:
            model = builder(**self.kwargs)
        except (ValueError, TypeError) as exc:
            raise ModelSpecError(f"model {self.name!r} {self.kwargs}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a plugin's builder is foreign code: its failure is one line
            raise ModelSpecError(f"{who}: its builder failed ({type(exc).__name__}: {str(exc)[:160]})") from None
        if not isinstance(model, nn.Module):
            raise ModelSpecError(f"{who}: its builder returned {type(model).__name__}, not a torch.nn.Module")
        if not any(True for _ in model.parameters()):
            raise ModelSpecError(f"{who}: the model has no parameters to fit")
        return model

    @functools.cached_property
    def _parameter_count(self) -> int:
        import torch

        with torch.device("meta"):
            return sum(p.numel() for p in self._construct().parameters())

    def parameter_count(self) -> int:
        """Number of parameters, computed once on PyTorch's meta device (nothing is allocated):
        ``build()`` checks it before every construction, and models are built per member."""
        return self._parameter_count

    def check_size(self, max_memory: int | str | None = None) -> int:
        """Refuse, before any allocation, a model over :data:`MAX_PARAMETERS` or whose training
        state (:data:`TRAINING_BYTES_PER_PARAMETER` per parameter) is over the memory budget."""
        n = self.parameter_count()
        if n > MAX_PARAMETERS:
            raise ModelSpecError(f"model {self.name!r} {self.kwargs} has {n:,} parameters, over the cap of "
                                 f"{MAX_PARAMETERS:,}")
        budget.require(n * TRAINING_BYTES_PER_PARAMETER, f"model {self.name!r} {self.kwargs} ({n:,} parameters)",
                       max_memory)
        return n

    def build(self) -> nn.Module:
        """The model, on PyTorch's default device. Off the meta device its size is checked first
        (:meth:`check_size` with the default budget), so a hostile spec allocates nothing. Every
        ``nn.MultiheadAttention`` is built as :class:`~posterior_fusion.models.attention.LinearAttention` (the
        same function from the same weights, its projections ``nn.Linear``). A fine-tuning spec's model has
        its trainable parameters only, the frozen weights buffers holding ``base``'s."""
        import torch

        meta = torch.get_default_device().type == "meta"
        if not meta:
            self.check_size()
        from posterior_fusion.models.attention import linear_attention

        model = linear_attention(self._construct())  # attention as four Linear maps (the same function)
        from posterior_fusion.models.finetune import apply_finetune, statistics_names

        batch_norm = bool(statistics_names(model))
        if self.finetune == "all" and not batch_norm:
            return model
        if self.base is None and not meta and self.finetune != "all":
            raise ModelSpecError(f"model {self.name!r} fine-tunes {self.finetune} of a base this spec does not hold "
                                 "(its frozen weights come with the artifact, `/frozen`)")
        # without a base, a BatchNorm model's statistics are frozen at (0, 1): a model trained from random
        # starting points has its own folded into its affine parameters (models/batchnorm.py)
        return apply_finetune(model, self.finetune, None if meta else self.base)  # on meta: shapes only

    def architecture(self) -> nn.Module:
        """The builder's module as a user builds it — every weight a parameter, a BatchNorm's statistics ordinary
        buffers, nothing frozen — with attention as four linear maps (:mod:`.attention`): what an exported
        network's ``state_dict`` loads into."""
        import torch

        if torch.get_default_device().type != "meta":
            self.check_size()
        from posterior_fusion.models.attention import linear_attention

        return linear_attention(self._construct())

    def frozen_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of the base weights a fine-tuning spec freezes (none for ``all``; a BatchNorm
        model's statistics always), read once on the meta device: the layout of an artifact's ``/frozen``."""
        return list(self._frozen_shapes)

    @functools.cached_property
    def _frozen_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        import torch

        from posterior_fusion.models.attention import linear_attention
        from posterior_fusion.models.finetune import frozen_names

        with torch.device("meta"):
            return tuple(frozen_names(linear_attention(self._construct()), self.finetune))

    def with_base(self, base: Mapping[str, Any] | None) -> ModelSpec:
        """This spec holding ``base`` (pretrained weights by parameter name) for its frozen weights."""
        return replace(self, base=base)

    def frozen_vector(self):
        """The frozen weights ``(Σ sizes,)`` float32 in :meth:`frozen_shapes` order (from ``base``)."""
        import torch

        shapes = self.frozen_shapes()
        if shapes and self.base is None and self.finetune != "all":
            raise ModelSpecError(f"model {self.name!r} fine-tunes {self.finetune}: no base to store")
        if not shapes:
            return torch.zeros(0)
        if self.base is None:  # BatchNorm statistics only, frozen at (0, 1): a folded model's (models/batchnorm.py)
            return torch.cat([(torch.ones if n.endswith("running_var") else torch.zeros)(math.prod(s))
                              for n, s in shapes])
        return torch.cat([torch.as_tensor(self.base[n]).detach().float().reshape(-1) for n, _ in shapes])

    def fitted_to(self, input_shape: tuple[int, ...], num_classes: int, where: str) -> ModelSpec:
        """This spec with what the data determines filled in where the spec leaves it out and the
        builder takes it: ``num_classes``, ``in_features`` (the number of input values) and, for
        images ``(C, H, W)``, ``in_channels`` — recorded only where it differs from the builder's
        default, so a spec that already fits stays as it was. An explicit value that disagrees is refused."""
        builder, allowed, _ = resolve_model(self.name, self.provider)
        params = inspect.signature(builder).parameters
        from_data = {"num_classes": num_classes, "in_features": math.prod(input_shape)}
        if len(input_shape) == 3:
            from_data["in_channels"] = input_shape[0]
        kwargs = dict(self.kwargs)
        for key, value in from_data.items():
            if key not in allowed:
                continue
            if key in kwargs and kwargs[key] != value:
                raise ModelSpecError(f"{where}: the data gives {key}={value}, but `model_kwargs` sets "
                                     f"{key}={kwargs[key]}; leave it out to take it from the data")
            if key not in kwargs and (key not in params or params[key].default != value):
                kwargs[key] = value
        return ModelSpec(self.name, kwargs, self.provider, self.finetune, self.base)

    def check_input(self, sample_shape: tuple[int, ...], where: str) -> None:
        """Refuse data whose per-sample shape (after the loader's channel axis) does not fit
        this model; runs the model on PyTorch's meta device (no allocation, no compute)."""
        import torch

        with torch.device("meta"):
            model = self.build()
            try:
                out = model(torch.empty(2, *sample_shape))
            except (RuntimeError, ValueError, IndexError) as exc:
                raise ModelSpecError(f"{where}: inputs of shape {tuple(sample_shape)} do not fit model "
                                     f"{self.name!r} {self.kwargs} ({(str(exc).splitlines() or [''])[0][:120]})") from None
            except Exception as exc:  # noqa: BLE001 - a plugin's forward is foreign code: its failure is one line
                raise ModelSpecError(f"{where}: model {self.name!r}'s forward failed on inputs of shape "
                                     f"{tuple(sample_shape)} ({type(exc).__name__}: {str(exc)[:120]})") from None
        if not isinstance(out, torch.Tensor):
            raise ModelSpecError(f"{where}: model {self.name!r}'s forward returned {type(out).__name__}; it must return "
                                 "one tensor of logits (n, classes)")
        if tuple(out.shape) != (2, self.num_classes):
            raise ModelSpecError(f"{where}: model {self.name!r} gives outputs {tuple(out.shape[1:])} on inputs "
                                 f"of shape {tuple(sample_shape)}, expected ({self.num_classes},)")

    def check_token_ids(self, x, where: str) -> None:
        """Refuse inputs ``x`` ``(n, ...)`` (array or tensor) whose token ids fall outside an ``nn.Embedding``'s
        table, in one line naming ``where`` and the largest id — before any training or prediction. Only integral
        inputs to a model with embeddings are checked: the rows holding the largest and the smallest value are run
        through the model once (an id no table holds fails there, whichever table the model feeds it to)."""
        import numpy as np
        import torch
        from torch import nn

        with torch.device("meta"):
            tables = [m.num_embeddings for m in self.build().modules() if isinstance(m, nn.Embedding)]
        arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        if not tables or arr.size == 0 or arr.dtype.kind not in "fiub":
            return
        flat = arr.reshape(len(arr), -1)
        if arr.dtype.kind == "f" and not np.array_equal(flat[:64], np.round(flat[:64])):
            return  # not token ids
        rows = sorted({int(flat.max(1).argmax()), int(flat.min(1).argmin())})
        largest, smallest = flat.max(), flat.min()
        model = self.build().eval()
        try:
            with torch.no_grad():
                model(torch.as_tensor(arr[rows]).float())
        except IndexError:
            raise ModelSpecError(f"{where}: token ids run from {smallest:g} to {largest:g}, beyond the model's "
                                 f"embedding tables ({', '.join(map(str, tables))} entries): ids must be in "
                                 "[0, table size)") from None

    @functools.cached_property
    def num_classes(self) -> int:
        """Outputs of the model: its ``num_classes`` argument, else the builder's default for it,
        else the last Linear layer's width (read on the meta device)."""
        if "num_classes" in self.kwargs:
            return int(self.kwargs["num_classes"])
        default = inspect.signature(resolve_model(self.name, self.provider)[0]).parameters.get("num_classes")
        if default is not None and isinstance(default.default, int):
            return default.default
        import torch

        with torch.device("meta"):
            linear = [m for m in self._construct().modules() if isinstance(m, nn.Linear)]
        if not linear:
            raise ModelSpecError(f"model {self.name!r}: cannot tell its number of classes (no num_classes "
                                 "argument and no Linear layer)")
        return linear[-1].out_features

    def to_json(self) -> str:
        obj = {"name": self.name, "kwargs": self.kwargs}
        if self.provider:
            obj["provider"] = self.provider
        if self.finetune != "all":
            obj["finetune"] = self.finetune
        return json.dumps(obj, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ModelSpecError(f"model spec is not valid JSON: {exc}") from None
        if (not isinstance(obj, dict) or not {"name", "kwargs"} <= set(obj) <= {"name", "kwargs", "provider", "finetune"}
                or not isinstance(obj["name"], str) or not isinstance(obj.get("provider", ""), str)):
            raise ModelSpecError('model spec must be {"name": str, "kwargs": {...}} (and optionally "provider", '
                                 '"finetune")')
        return cls(obj["name"], obj["kwargs"], obj.get("provider"), obj.get("finetune", cls.finetune))
