"""laplace-torch as a capture: the oracle the fast capture is tested against, and the option
``capture = "laplace"``. This is the only module that imports laplace-torch. Backends chosen by
measurement (``docs/benchmarks.md``, "Capture"): kron via Curvlinops K-FAC; diag via ASDL (the
default Curvlinops diag is far slower); last-layer full via Curvlinops. Each returns the raw GGN
summed over the data as a :class:`BlockDiag` (no prior, no temperature)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from posterior_fusion.choices import GGN_TYPES
from posterior_fusion.curvature import BlockDiag, Dense, Diag, Kron, Precision
from posterior_fusion.errors import ConfigError
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.progress import LoaderProgress


def _loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, desc: str = "curvature") -> LoaderProgress:
    return LoaderProgress(DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False), desc)


def laplace_backends():
    """laplace-torch's ``Laplace`` and its two curvature backends, imported here and only here (the
    default fast path never imports it). A broken install — usually a torchvision built for another
    torch, which laplace-torch's dependencies pull in — ends in one line that says how to fix it."""
    try:
        from laplace import Laplace
        from laplace.curvature import AsdlGGN, CurvlinopsGGN
    except ModuleNotFoundError as exc:
        if exc.name not in ("laplace", "asdl", "asdfghjkl", "curvlinops", "backpack"):
            raise ConfigError(f"laplace-torch cannot be imported (missing module {exc.name!r}); the default `capture: "
                              "fast` does not need it") from None
        raise ConfigError("`capture: laplace` needs laplace-torch, an optional install: laplace-torch==0.3, "
                          "backpack-for-pytorch, curvlinops-for-pytorch and asdfghjkl without their dependencies "
                          "(pip install's no-deps option: their metadata would replace your torch through "
                          "torchvision; README, 'With pip'); the default `capture: fast` does not need it") from None
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


LAPLACE_CAPTURE = {"kron": capture_kron, "diag": capture_diag, "diag+full": capture_diag_full}
