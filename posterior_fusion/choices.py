"""The named choices of the settings, declared once and without the numerics: each is a string enum
(:class:`Choice`) whose every value carries a one-line doc, which the settings records
(``setting(choices=...)``), the CLI's ``--help`` and ``--help-method`` show. Building a command's options
imports no torch (start-up: ``docs/benchmarks.md``). The code that acts on a choice compares with its values
(the tuples beside each enum are ``Enum.values()``).
"""

from __future__ import annotations

import enum
import re


class Choice(str, enum.Enum):
    """A setting's named values: ``NAME = "value", "one-line doc"``; a member is its value as a string."""

    doc: str

    def __new__(cls, value: str, doc: str) -> Choice:
        member = str.__new__(cls, value)
        member._value_ = value
        member.doc = doc
        return member

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """The values in declaration order."""
        return tuple(m.value for m in cls)


class Structure(Choice):
    """Curvature a silo captures."""

    KRON = "kron", "K-FAC, a Kronecker factor pair per Linear/Conv2d weight"
    DIAG = "diag", "the GGN diagonal"
    DIAG_FULL = "diag+full", "the diagonal plus the last Linear layer's full block"


class GgnType(Choice):
    """Which generalised Gauss-Newton."""

    EXACT = "exact", "the exact GGN (one backward pass per class)"
    MC = "mc", "the Monte-Carlo Fisher, one sampled label (faster)"


class CaptureMethod(Choice):
    """Who computes the curvature."""

    FAST = "fast", ("this package's capture (one forward + one batched backward per batch; a model it cannot take "
                    "is refused before training)")
    LAPLACE = "laplace", "laplace-torch (an optional install), the oracle"


class CaptureDtype(Choice):
    """The fast capture's arithmetic."""

    FLOAT32 = "float32", "the model's float32"
    BFLOAT16 = "bfloat16", ("bfloat16 autocast: about 2x faster passes on a CPU with AVX512-BF16, factors within "
                            "~0.5 % of float32's, still summed in float64")


class KfacType(Choice):
    """K-FAC over weight-shared (convolution) positions."""

    EXPAND = "expand", "positions as samples (laplace-torch's default)"
    REDUCE = "reduce", ("each sample's positions summed first: far cheaper on convolutions "
                        "(Eschenhagen et al. 2023)")


class CompressMetric(Choice):
    """The error a compressed Kronecker factor bounds."""

    FROBENIUS = "frobenius", ("each factor's relative Frobenius error, the remainder keeping the trace: lower "
                              "ranks, but the precision's weak directions may move by factors")
    PRECISION = "precision", "the precision's eigenvalues' relative error (what fusion sees)"


class VectorDtype(Choice):
    """Storage type of a compressed factor's kept eigenvectors."""

    FLOAT32 = "float32", "as computed"
    FLOAT16 = "float16", ("about half the bytes: eigenvectors that rounding would push past `compress` stay "
                          "float32, the reader makes them orthonormal again")


class Predictive(Choice):
    """How a global artifact predicts."""

    MAP = "map", "the members' softmax averaged"
    MC = "mc", "Monte-Carlo over weight samples around each mode"
    GLM = "glm", "the linearised predictive (a fedbens artifact with its Laplace posterior)"
    GLM_LAST_LAYER = "glm-last-layer", "the same with only the last Linear layer uncertain (faster)"


class Link(Choice):
    """The GLM predictive's link."""

    PROBIT = "probit", "the probit approximation"
    MC = "mc", "Monte-Carlo over the Gaussian logits"


class BatchnormPolicy(Choice):
    """A BatchNorm model trained from random starting points."""

    FOLD = "fold", ("train with batch statistics, then estimate them on the silo and fold them into the affine "
                    "parameters (statistics (0, 1) frozen; each component's stored for the server's reset)")
    REFUSE = "refuse", "one error line before training"


class Kernel(Choice):
    """The batched Kronecker kernels' backend."""

    TORCH = "torch", "batched torch products, on a CPU or a GPU"
    TRITON = "triton", "fused GPU kernels"


class BatchnormStatistics(Choice):
    """The fused model's BatchNorm statistics where the clients folded theirs."""

    FOLD = "fold", "the fused affine maps as they are (no data)"
    RESET = "reset", "estimated again on the server's inputs"


class Device(Choice):
    """Where a computation runs."""

    AUTO = "auto", "cuda where a GPU is visible, else cpu"
    CPU = "cpu", "the CPU"
    CUDA = "cuda", "the first visible GPU"


class Optimizer(Choice):
    """A silo's optimiser."""

    SGD = "sgd", "momentum SGD with the prior's pull in the gradient: training stops at the posterior's mode"
    ADAM = "adam", "Adam with the prior's pull in the gradient"
    ADAMW = "adamw", ("Adam with the pull decoupled (AdamW), as transformers are trained; its fixed point is "
                      "near the mode, not at it")


class Schedule(Choice):
    """A learning-rate schedule."""

    CONSTANT = "constant", "the step size throughout"
    COSINE = "cosine", "cosine decay to 0"


class PoolingRule(Choice):
    """How an ensemble's members' predictions combine."""

    AVERAGE = "average", "the mean of all C x M members"
    LABEL_SHIFT = "label-shift", ("each client's members averaged, the clients pooled class by class from their "
                                  "recorded class counts")


class Protocol(Choice):
    """How a data set is split into silos."""

    OURS = "ours", "this package's Dirichlet split"
    FEDBENS_REFERENCE = "fedbens-reference", "the FedBEns authors' split (pfuse partition --help)"


STRUCTURES = Structure.values()
GGN_TYPES = GgnType.values()
CAPTURE_METHODS = CaptureMethod.values()
CAPTURE_DTYPES = CaptureDtype.values()
KFAC_TYPES = KfacType.values()
COMPRESS_METRICS = CompressMetric.values()
VECTOR_DTYPES = VectorDtype.values()
PREDICTIVES = Predictive.values()
LINKS = Link.values()
BATCHNORM_POLICIES = BatchnormPolicy.values()
KERNELS = Kernel.values()
BATCHNORM_STATISTICS = BatchnormStatistics.values()
DEVICES = Device.values()
POOLINGS = PoolingRule.values()
PROTOCOLS = Protocol.values()

FINETUNE_RE = re.compile(r"^(all|head|last:[1-9][0-9]{0,3}|lora:[1-9][0-9]{0,3})$")
"""What a silo fine-tunes of a pretrained base: all, head, last:K or lora:R (K, R in 1..9999)."""
