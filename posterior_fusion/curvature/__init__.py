"""Structured curvature / precision matrices sharing one protocol (:class:`Precision`)."""

from posterior_fusion.curvature.base import Precision, eigh_psd
from posterior_fusion.curvature.blockdiag import BlockDiag
from posterior_fusion.curvature.dense import Dense
from posterior_fusion.curvature.diag import Diag
from posterior_fusion.curvature.kron import Kron

__all__ = ["Precision", "Diag", "Dense", "Kron", "BlockDiag", "eigh_psd"]
