"""Structured curvature / precision matrices sharing one protocol (:class:`Precision`).

:data:`BLOCK_TYPES` is the block-type table: ``kind`` (as stored in artifacts) -> class. The
artifact reader and writer and the fusion stack find a block's class here; adding a block
type means writing its class (protocol + storage + ``stacked``, whose stacked block evaluates
``quadratic_forms`` and ``forms_and_vjp``: see :class:`~posterior_fusion.curvature.base.StackedBlock`)
and adding it to this table (and, to produce it, a capture in ``local/capture.py``).
"""

from posterior_fusion.curvature.base import BlockValueError, Precision, eigh_psd
from posterior_fusion.curvature.blockdiag import BlockDiag
from posterior_fusion.curvature.dense import Dense
from posterior_fusion.curvature.diag import Diag
from posterior_fusion.curvature.kron import Kron

BLOCK_TYPES: dict[str, type[Precision]] = {cls.kind: cls for cls in (Diag, Dense, Kron)}

__all__ = ["Precision", "Diag", "Dense", "Kron", "BlockDiag", "BLOCK_TYPES", "BlockValueError", "eigh_psd"]
