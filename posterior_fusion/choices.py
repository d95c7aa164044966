"""The named choices of the settings several layers share, declared once and without the numerics:
the settings records, the CLI's options and its ``--help`` read them here, so building a command's
options imports no torch (start-up: ``docs/benchmarks.md``). The code that acts on a choice imports it
from here too.
"""

from __future__ import annotations

import re

STRUCTURES = ("kron", "diag", "diag+full")
"""Curvature a silo can capture: K-FAC (``Kron`` per Linear/Conv2d weight), the GGN diagonal, or the
diagonal plus the last Linear layer's full block."""

GGN_TYPES = ("exact", "mc")
"""exact: the exact GGN (C − 1 back-propagated columns per sample); mc: the Monte-Carlo Fisher (one sampled label)."""

CAPTURE_METHODS = ("fast", "laplace")
"""fast: this package's capture; laplace: laplace-torch (an optional install), the oracle."""

CAPTURE_DTYPES = ("float32", "bfloat16")
"""The fast capture's passes: in the model's float32, or under bfloat16 autocast."""

KFAC_TYPES = ("expand", "reduce")
"""K-FAC over weight-shared positions: expand (positions as samples) or reduce (each sample's positions summed first)."""

COMPRESS_METRICS = ("frobenius", "precision")
"""The error a compressed Kronecker factor bounds: its relative Frobenius error, or the precision's eigenvalues'."""

VECTOR_DTYPES = ("float32", "float16")
"""Storage type of a compressed factor's kept eigenvectors."""

PREDICTIVES = ("map", "mc", "glm", "glm-last-layer")
"""map: the members' softmax averaged; mc: Monte-Carlo over weights; glm: the linearised predictive; glm-last-layer:
the same with only the last Linear layer uncertain."""

LINKS = ("probit", "mc")
"""The GLM predictive's link: the probit approximation, or Monte-Carlo over the Gaussian logits."""

BATCHNORM_POLICIES = ("fold", "refuse")
"""A BatchNorm model trained from random starting points: fold (train with batch statistics, then fold the silo's
statistics into the affine parameters) or refuse (one error line before training)."""

KERNELS = ("torch", "triton")
"""The batched Kronecker kernels' backend: torch (batched products, the default) or triton (fused GPU kernels)."""

BATCHNORM_STATISTICS = ("fold", "reset")
"""The fused model's BatchNorm: fold (the fused affine maps as they are) or reset (statistics estimated again on the
server's inputs, RESET)."""

FINETUNE_RE = re.compile(r"^(all|head|last:[1-9][0-9]{0,3}|lora:[1-9][0-9]{0,3})$")
"""What a silo fine-tunes of a pretrained base: all, head, last:K or lora:R (K, R in 1..9999)."""
