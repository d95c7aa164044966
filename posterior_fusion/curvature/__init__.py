"""Structured curvature / precision matrices sharing one protocol (:class:`Precision`): the maths
of one precision, importing nothing above it.

:data:`BLOCK_TYPES` is the block-type table: ``kind`` (as stored in artifacts) -> class. The
the curvature code finds a block's class here; adding a block type means writing its class
(the protocol and ``to_tensors``) and adding it to this table, its file encoding to
:data:`posterior_fusion.artifact.blocks.ENCODINGS`, its batched evaluation to
:data:`posterior_fusion.fusion.block_stacks.STACKERS` (see its ``StackedBlock``), and, to produce
it, a capture in ``local/capture.py``.
"""

from posterior_fusion.curvature.base import Precision, eigh_psd
from posterior_fusion.curvature.blockdiag import BlockDiag
from posterior_fusion.curvature.compressed import CompressedKron
from posterior_fusion.curvature.dense import Dense
from posterior_fusion.curvature.diag import Diag
from posterior_fusion.curvature.kron import Kron

BLOCK_TYPES: dict[str, type[Precision]] = {cls.kind: cls for cls in (Diag, Dense, Kron, CompressedKron)}

__all__ = ["Precision", "Diag", "Dense", "Kron", "CompressedKron", "BlockDiag", "BLOCK_TYPES", "eigh_psd"]
