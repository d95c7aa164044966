"""Batched Kronecker operations with one dispatch API.

``kron_quadratic_form`` is the hot loop of the FedBEns server: all components of a layer at
once, no Python loop over components. On the CPU the torch reference runs; GPU kernels
(Triton) would register here (see issue tracker).
"""

from posterior_fusion.kernels.reference import kron_quadratic_form, kron_sample

__all__ = ["kron_quadratic_form", "kron_sample"]
