"""Curvature capture: the fast path (``local/fastcapture.py``) or laplace-torch. This is the
only module importing laplace.

Returns the raw GGN summed over the data as a :class:`BlockDiag` (no prior, no temperature).
laplace-torch backends (chosen by measurement, ``docs/benchmarks.md``): kron via Curvlinops K-FAC;
diag via ASDL (the default Curvlinops diag is far slower); last-layer full via Curvlinops. ``capture(...,
method="fast")`` computes the same quantities for models whose parameters all sit in Linear /
Conv2d layers, and falls back to laplace-torch for any other model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron, Precision
from posterior_fusion.errors import ConfigError
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.progress import LoaderProgress

GGN_TYPES = ("exact", "mc")
CAPTURE_METHODS = ("fast", "laplace")
CAPTURE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}  # the fast capture's passes: the model's type, or autocast


def capture_dtype_problem(capture_dtype: str, method: str, fast_problem: str | None) -> str | None:
    """Why ``capture_dtype`` cannot be honoured (None when it can): a type other than float32 needs
    the fast capture (laplace-torch's backends run in the model's type). ``fast_problem``: why the fast
    capture cannot take the model (``fastcapture.unsupported_reason``; None when it can)."""
    if capture_dtype not in CAPTURE_DTYPES:
        return f"unknown `capture_dtype` {capture_dtype!r}; use one of {', '.join(CAPTURE_DTYPES)}"
    if capture_dtype == "float32":
        return None
    if method != "fast":
        return f"`capture_dtype` {capture_dtype} needs the fast capture (`capture` fast), not laplace-torch"
    if fast_problem is not None:
        return f"`capture_dtype` {capture_dtype} needs the fast capture, which this model cannot use ({fast_problem})"
    return None


def _loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, desc: str = "curvature") -> LoaderProgress:
    return LoaderProgress(DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False), desc)


def laplace_backends():
    """laplace-torch's ``Laplace`` and its two curvature backends, imported here and only here (the
    default fast path never imports it). A broken install — usually a torchvision built for another
    torch, which laplace-torch's dependencies pull in — ends in one line that says how to fix it."""
    try:
        from laplace import Laplace
        from laplace.curvature import AsdlGGN, CurvlinopsGGN
    except Exception as exc:  # noqa: BLE001 - any import failure of the optional backend is one line
        first = (str(exc).splitlines() or [""])[0][:160]
        raise ConfigError(f"laplace-torch cannot be imported ({type(exc).__name__}: {first}); the usual cause is a "
                          f"torchvision built for another torch than {torch.__version__}: `pip uninstall torchvision` "
                          "(pfuse does not use it) or install the matching one; the default `capture: fast` does not "
                          "need laplace-torch") from None
    return Laplace, AsdlGGN, CurvlinopsGGN


def _laplace(model: nn.Module, structure: str, subset: str, backend, ggn: str = "exact", **extra):
    Laplace, _, _ = laplace_backends()

    if ggn not in GGN_TYPES:
        raise ConfigError(f"unknown GGN type {ggn!r}; use 'exact' or 'mc'")
    # A fresh copy per Laplace object: backends leave hooks behind on the model.
    return Laplace(copy.deepcopy(model), "classification", subset_of_weights=subset,
                   hessian_structure=structure, backend=backend,
                   backend_kwargs={"stochastic": ggn == "mc"}, **extra)


def capture_kron(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256, ggn: str = "exact",
                 kfac: str = "expand") -> BlockDiag:
    """K-FAC GGN: one ``Kron(B, A)`` per weight, one ``Dense`` per bias (laplace-torch's blocks);
    ``kfac``: curvlinops' "expand" or "reduce" approximation for weight-shared layers."""
    _, _, CurvlinopsGGN = laplace_backends()
    la = _laplace(model, "kron", "all", CurvlinopsGGN, ggn, asdl_fisher_kwargs={"kfac_approx": kfac})
    la.fit(_loader(x, y, batch_size))
    layout = ParameterLayout.from_model(model)
    blocks: list[Precision] = []
    for entry, facs in zip(layout.entries, la.H_facs.kfacs):
        facs = [f.detach().clone() for f in facs]
        if len(facs) == 2:
            if (facs[0].shape[0], facs[1].shape[0]) != entry.matrix_shape:
                raise RuntimeError(f"unexpected K-FAC factor shapes for {entry.name}: {[f.shape for f in facs]}")
            blocks.append(Kron(facs[0], facs[1]))
        else:
            blocks.append(Dense(facs[0]))
    return BlockDiag(blocks)


def capture_diag_vector(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256,
                        ggn: str = "exact") -> torch.Tensor:
    """Diagonal of the GGN, ``(d,)``, through the ASDL backend."""
    _, AsdlGGN, _ = laplace_backends()
    la = _laplace(model, "diag", "all", AsdlGGN, ggn)
    la.fit(_loader(x, y, batch_size))
    return la.H.detach().clone()


def capture_diag(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256, ggn: str = "exact") -> BlockDiag:
    return BlockDiag([Diag(capture_diag_vector(model, x, y, batch_size, ggn))])


def capture_diag_full(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256,
                      ggn: str = "exact") -> BlockDiag:
    """Diag GGN for all but the last layer, exact full GGN block of the last ``nn.Linear``."""
    _, _, CurvlinopsGGN = laplace_backends()
    g = capture_diag_vector(model, x, y, batch_size, ggn)
    la = _laplace(model, "full", "last_layer", CurvlinopsGGN, ggn)
    la.fit(_loader(x, y, batch_size))
    H = la.H.detach().clone()
    p = H.shape[0]
    return BlockDiag([Diag(g[:-p]), Dense(0.5 * (H + H.T))])


CAPTURE = {"kron": capture_kron, "diag": capture_diag, "diag+full": capture_diag_full}


def capture(structure: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256,
            ggn: str = "exact", method: str = "fast", generator: torch.Generator | None = None,
            log=lambda m: None, kfac: str = "expand", capture_dtype: str = "float32") -> tuple[BlockDiag, str]:
    """Raw curvature of ``structure`` and the method that computed it (``"fast"`` or ``"laplace"``).

    ``ggn="exact"``: exact GGN (one backward pass per class); ``"mc"``: Monte-Carlo Fisher with
    one sampled label (``generator`` draws it on the fast path). ``method="fast"`` uses
    :mod:`posterior_fusion.local.fastcapture` when the model is supported (else laplace-torch,
    with a log line); the last-layer full block of ``diag+full`` is always exact on the fast path
    (closed form, cheaper than sampling). ``kfac`` ("expand" or "reduce") applies to ``kron``.
    ``capture_dtype`` "bfloat16": the fast capture's forward and backward passes under bfloat16
    autocast (the factors still summed in float64 from those vectors); refused where the fast
    capture is not used (:func:`capture_dtype_problem`)."""
    from posterior_fusion.local.fastcapture import FAST_CAPTURE, KFAC_TYPES, unsupported_reason

    if structure not in CAPTURE:
        raise ConfigError(f"unknown curvature structure {structure!r}; use one of {', '.join(CAPTURE)}")
    if method not in CAPTURE_METHODS:
        raise ConfigError(f"unknown capture method {method!r}; use one of {', '.join(CAPTURE_METHODS)}")
    if ggn not in GGN_TYPES:
        raise ConfigError(f"unknown GGN type {ggn!r}; use one of {', '.join(GGN_TYPES)}")
    if kfac not in KFAC_TYPES:
        raise ConfigError(f"unknown K-FAC type `kfac` {kfac!r}; use one of {', '.join(KFAC_TYPES)}")
    reason = unsupported_reason(model, x[:2]) if method == "fast" else None
    problem = capture_dtype_problem(capture_dtype, method, reason)
    if problem is not None:
        raise ConfigError(problem)
    extra = {"kfac": kfac} if structure == "kron" else {}
    if CAPTURE_DTYPES[capture_dtype] is not None:
        extra["compute_dtype"] = CAPTURE_DTYPES[capture_dtype]
    if method == "fast":
        if reason is None:
            return FAST_CAPTURE[structure](model, x, y, batch_size, ggn, generator, **extra), "fast"
        log(f"fast capture not available ({reason}); using laplace-torch")
    if x.device.type != "cpu":
        model, x, y = copy.deepcopy(model).cpu(), x.cpu(), y.cpu()  # laplace-torch's backends run here on the CPU
    return CAPTURE[structure](model, x, y, batch_size, ggn, **extra), "laplace"
