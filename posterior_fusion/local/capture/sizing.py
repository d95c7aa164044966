"""How many samples one capture pass takes: bounded by the activations it keeps for its backward
passes (host memory on a CPU, a share of the free memory on a GPU). The captured sums do not
depend on the grouping."""

from __future__ import annotations

import torch
from torch import nn

from posterior_fusion.models.jacobians import output_bytes

PASS_BYTES = 384 * 2**20  # on the CPU: bound of the activations one capture pass keeps for its backward passes


GPU_PASS_SHARE = 0.25  # on a GPU: the share of its memory free at capture time that one pass may keep


def pass_bytes(device: torch.device) -> int:
    """Bytes of activations one capture pass may keep: :data:`PASS_BYTES` of host memory on the CPU
    (what bounds ``fit-local``'s resident peak); on a GPU :data:`GPU_PASS_SHARE` of the memory free on it
    now. A GPU held to the CPU's bound runs many small passes and waits on their kernel launches: ResNet-20
    at width 64 was captured in 52 passes of 20 samples on an H200, K-FAC-reduce with the MC GGN costing
    11 epochs (docs/benchmarks.md, "On a GPU: models at real size")."""
    if device.type == "cuda":
        return int(GPU_PASS_SHARE * torch.cuda.mem_get_info(device)[0])
    return PASS_BYTES


def pass_size(model: nn.Module, x: torch.Tensor, batch_size: int) -> int:
    """Samples per capture pass: ``batch_size``, or fewer where the activations the pass keeps for
    its C − 1 backward passes (estimated as twice every module output of one sample, the graph's
    saved tensors and the output gradients) would exceed :func:`pass_bytes` on ``x``'s device. The
    captured sums do not depend on how the samples are grouped (MC labels are drawn row by row from
    the same generator), so this bounds the peak memory of large models without changing the result."""
    per_sample = max(1, 2 * sum(output_bytes(model, x[:1])))
    return max(1, min(batch_size, pass_bytes(x.device) // per_sample))
