"""Inputs synthesised for distillation without server data (the ``data-free`` recipe).

**Data-free** (no server inputs; DeepInversion-style, Yin et al. 2020): the inputs are synthesised from what
the artifacts already hold — the teachers themselves, and each client's first-layer K-FAC input factor, the
second moment ``A = E[u uᵀ]`` of that layer's inputs (a convolution's patches, a Linear layer's features).
Batches of synthetic inputs start as noise and take ``synth_steps`` Adam steps on the teacher's cross-entropy
toward random target classes (confident, class-balanced) plus ``moment_weight`` × the relative Frobenius
mismatch between their own first-layer second moment and the clients' pooled one (weighted by the clients'
sizes), and a small total-variation term for images. Nothing new leaves a silo: the factor is in every K-FAC
artifact already. The synthetic set then feeds the consistent recipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import vector_to_parameters

from posterior_fusion.errors import ConfigError
from posterior_fusion.fusion.distill_settings import TeachingConfig
from posterior_fusion.models import ModelSpec
from posterior_fusion.progress import progress

MOMENT_NETWORKS = 8  # the clients' own networks whose later layers' input moments the synthesis matches


def first_layer(model: nn.Module) -> nn.Module:
    """The first Linear or Conv2d of ``model`` (the layer whose K-FAC input factor describes the inputs)."""
    return next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))


def input_second_moment(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``E[u uᵀ]`` ``(D, D)`` of ``layer``'s inputs on ``x``, as K-FAC's (expand) input factor of its weight: a
    convolution's patches (``F.unfold``'s (channel, kh, kw) order) averaged over the samples and positions, a
    Linear layer's features over the samples. Differentiable in ``x``."""
    if isinstance(layer, nn.Conv2d):
        cols = nn.functional.unfold(x, layer.kernel_size, layer.dilation, layer.padding, layer.stride)  # (b, D, S)
        u = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    else:
        u = x.reshape(x.shape[0], -1)
    return u.T @ u / u.shape[0]


def check_expand_factors(clients) -> None:
    """Refuse, naming the file, a client whose K-FAC input factors are not ``expand`` ones: the synthesis matches
    :func:`input_second_moment`, the expand factor (``reduce`` averages a convolution's patches first)."""
    for client in clients:
        if client.metadata.get("kfac") not in (None, "expand"):  # the writer leaves out the default, expand
            raise ConfigError(f"{client.path}: distillation without server inputs matches K-FAC expand input "
                              f"factors; this artifact holds kfac {client.metadata.get('kfac')!r} (give `unlabeled` "
                              "server inputs, or fit with kfac expand)")


def layer_factors(clients, most: int = MOMENT_NETWORKS) -> list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]]:
    """For up to ``most`` clients (spread over them), the first component's weights ``(d,)`` and, for each
    Linear or Conv2d layer after the first whose K-FAC (expand) input factor ``A`` ``(D, D)`` the component holds,
    ``(the layer's index among the model's Linear and Conv2d layers, A)``: what each client's own network saw at
    that layer's input, already in its artifact. Refused where the clients hold no such factor."""
    picked = [clients[int(i)] for i in torch.linspace(0, len(clients) - 1, min(most, len(clients))).round().long()]
    out = []
    for client in picked:
        component = client.components[0]
        named = [(n, m) for n, m in client.model_spec.build().named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        index, layers = {n: i for i, (n, _) in enumerate(named)}, [m for _, m in named]
        start_of = {e.offset: e.name for e in client.layout.entries}
        pairs = []
        for block, offset in zip(component.curvature.blocks, component.curvature.offsets):
            name = start_of.get(offset, "")
            module = name.rsplit(".", 1)[0] if name.endswith(".weight") else None
            i = index.get(module) if module is not None else None
            if i is None or i == 0 or not hasattr(block, "A"):
                continue
            layer = layers[i]
            width = layer.in_features if isinstance(layer, nn.Linear) else (
                layer.in_channels // layer.groups * math.prod(layer.kernel_size))
            if tuple(block.A.shape) == (width, width):
                pairs.append((i, block.A.float()))
        if pairs:
            out.append((component.map.float(), pairs))
    if not out:
        raise ConfigError("`distill_moment_layers` all needs the clients' K-FAC input factors of layers after the "
                          "first (structure kron)")
    return out


def synthesise(spec: ModelSpec, members: torch.Tensor, moment: torch.Tensor, input_shape: tuple[int, ...],
               cfg: TeachingConfig, teacher: Callable[[torch.Tensor], torch.Tensor],
               show_progress: bool = True,
               deeper: list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]] = ()) -> tuple[torch.Tensor, dict]:
    """``cfg.synth_size`` inputs of ``input_shape`` synthesised from the teacher and the clients' pooled first-layer
    input second moment ``moment`` ``(D, D)`` (module doc, "Data-free"); with ``deeper`` (:func:`layer_factors`),
    also the relative mismatch, under each client's own network, of every later layer's input second moment with
    its recorded factor (averaged over the layers and networks, weighted as the first layer's). A record: the final
    relative moment mismatch (and the later layers', where matched) and the teacher's mean confidence."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    layer = first_layer(spec.build())
    classes = spec.num_classes
    out, mismatch, confidence = [], [], []
    norm = moment.norm()
    batches = range(0, cfg.synth_size, cfg.batch_size)
    nets = [spec.build().eval() for _ in range(min(members.shape[0], 8))]  # the gradient: up to 8 members, built once
    for net, k in zip(nets, torch.linspace(0, members.shape[0] - 1, len(nets)).round().long()):
        vector_to_parameters(members[k].detach().clone().float(), net.parameters())
        net.requires_grad_(False)
    probes = []  # (network, its matched layers, their recorded factors, what each layer's input was on z)
    for w, pairs in deeper:
        net = spec.build().eval()
        vector_to_parameters(w.detach().clone(), net.parameters())
        net.requires_grad_(False)
        layers = [m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
        seen: dict[int, torch.Tensor] = {}
        for i, _ in pairs:
            layers[i].register_forward_pre_hook(lambda m, args, i=i, seen=seen: seen.__setitem__(i, args[0]))
        probes.append((net, [(layers[i], A, A.norm()) for i, A in pairs], [i for i, _ in pairs], seen))

    def deeper_gap(z: torch.Tensor) -> torch.Tensor:
        gaps = []
        for net, matched, order, seen in probes:
            net(z)
            gaps += [(input_second_moment(layer, seen[i]) - A).norm() / norm_a
                     for (layer, A, norm_a), i in zip(matched, order)]
        return torch.stack(gaps).mean()

    deeper_mismatch = []
    scale = float(moment.diagonal().mean().clamp_min(1e-12).sqrt())
    for start in progress(batches, "distill (synthesising inputs)", show=show_progress):
        b = min(cfg.batch_size, cfg.synth_size - start)
        z = (scale * torch.randn(b, *input_shape, generator=gen)).requires_grad_(True)
        target = torch.randint(0, classes, (b,), generator=gen)
        opt = torch.optim.Adam([z], lr=0.05 * scale)
        for _ in range(cfg.synth_steps):
            logp = torch.stack([torch.log_softmax(net(z), -1) for net in nets]).logsumexp(0) - math.log(len(nets))
            ce = nn.functional.nll_loss(logp, target)
            gap = (input_second_moment(layer, z) - moment).norm() / norm
            loss = ce + cfg.moment_weight * (gap if not probes else gap + deeper_gap(z))
            if z.ndim == 4:
                loss = loss + 1e-3 * ((z[..., 1:, :] - z[..., :-1, :]).abs().mean()
                                      + (z[..., :, 1:] - z[..., :, :-1]).abs().mean()) / scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            mismatch.append(float((input_second_moment(layer, z) - moment).norm() / norm))
            confidence.append(float(teacher(z).max(-1).values.mean()))
            if probes:
                deeper_mismatch.append(float(deeper_gap(z)))
        out.append(z.detach())
    return torch.cat(out), {"synthesised": cfg.synth_size, "moment_mismatch": max(mismatch),
                            "teacher_confidence": sum(confidence) / len(confidence),
                            **({"later_layers_mismatch": max(deeper_mismatch)} if probes else {})}


def pooled_input_moment(factors: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The clients' first-layer input second moments ``(D, D)`` each (K-FAC's input factor, an average over the
    client's data) pooled by their sizes: the second moment over all their data."""
    total = sum(sizes)
    return sum(f.double() * (n / total) for f, n in zip(factors, sizes)).float()


def client_input_moment(client) -> torch.Tensor | None:
    """A client artifact's first-layer input second moment ``(D, D)``: its components' K-FAC input factor of the
    first weight block (the average over components), or None where that block is not a Kronecker one."""
    factors = [c.curvature.blocks[0].A for c in client.components if getattr(c.curvature.blocks[0], "kind", "")
               in ("kron", "kron_lowrank") and hasattr(c.curvature.blocks[0], "A")]
    return None if not factors else torch.stack([f.float() for f in factors]).mean(0)


def synthetic_input_shape(cfg: TeachingConfig, clients) -> tuple[int, ...]:
    """One input's shape for data-free teaching: the setting ``input_shape``, else the one all ``clients`` record."""
    recorded = {tuple(c.metadata.get("input_shape") or ()) for c in clients}
    shape = cfg.shape() or (next(iter(recorded)) if len(recorded) == 1 and () not in recorded else None)
    if shape is None:
        raise ConfigError("distillation without server inputs needs one input's shape: the clients record none "
                          "(set the distillation setting input_shape, e.g. 1,28,28)")
    return shape
