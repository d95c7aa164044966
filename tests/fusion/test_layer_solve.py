"""Per-layer precision-sum solves (fusion/layer_solve.py) against dense float64."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_LAYOUT, random_curvature


def test_precision_sum_solve_with_one_shift_per_block_equals_the_dense_solve():
    """`solve_precision_sum` with a shift per block (Kronecker blocks by conjugate gradients, dense ones by
    Cholesky): the dense float64 solve of (Σ_k r_k P_k + blockdiag(s_j I)) w = Σ_k r_k P_k m_k + b."""
    from posterior_fusion.fusion.layer_solve import solve_precision_sum

    gen = torch.Generator().manual_seed(8)
    d = TINY_LAYOUT.dim
    terms = [(0.5 + k, random_curvature("kron", gen), torch.randn(d, generator=gen, dtype=torch.float64))
             for k in range(3)]
    shifts = [0.1, 2.0, 0.5, 7.0]  # one per block of TINY: W1, b1, W2, b2
    rhs = torch.randn(d, generator=gen, dtype=torch.float64)
    ours, info = solve_precision_sum(terms, shift=shifts, rhs=rhs, tolerance=1e-12)
    dense = [torch.block_diag(*[b.to_dense() for b in P.blocks]) for _, P, _ in terms]
    S = torch.diag(torch.cat([torch.full((b.dim,), s, dtype=torch.float64)
                              for b, s in zip(terms[0][1].blocks, shifts)]))
    A = sum(r * D for (r, _, _), D in zip(terms, dense)) + S
    want = torch.linalg.solve(A, sum(r * D @ m for (r, _, m), D in zip(terms, dense)) + rhs)
    torch.testing.assert_close(ours, want, rtol=1e-8, atol=1e-8)
    scalar, _ = solve_precision_sum(terms, shift=0.5, rhs=rhs, tolerance=1e-12)
    A1 = sum(r * D for (r, _, _), D in zip(terms, dense)) + 0.5 * torch.eye(d, dtype=torch.float64)
    torch.testing.assert_close(scalar, torch.linalg.solve(A1, sum(r * D @ m for (r, _, m), D in zip(terms, dense)) + rhs),
                               rtol=1e-8, atol=1e-8)


def test_an_indefinite_dense_block_is_one_clear_error_not_a_traceback():
    """A dense block whose summed precision is indefinite (a shift below minus its smallest eigenvalue) ends in
    :class:`IndefinitePrecisionError` naming the block and its eigenvalue range, not a LinAlgError."""
    from posterior_fusion.errors import IndefinitePrecisionError, PfuseError
    from posterior_fusion.fusion.layer_solve import solve_precision_sum

    gen = torch.Generator().manual_seed(3)
    d = TINY_LAYOUT.dim
    terms = [(1.0, random_curvature("kron", gen), torch.randn(d, generator=gen, dtype=torch.float64))]
    bias = terms[0][1].blocks[1]  # TINY's blocks: W1 (Kronecker), b1 (dense), W2, b2
    low = float(torch.linalg.eigvalsh(bias.to_dense().double())[0])
    with pytest.raises(IndefinitePrecisionError, match=r"curvature block 1 .*not positive definite") as err:
        solve_precision_sum(terms, shift=[0.0, -(low + 1.0), 0.0, 0.0])
    assert isinstance(err.value, PfuseError) and err.value.exit_code == 2


def test_an_indefinite_kronecker_block_is_an_error_where_strict():
    """A Kronecker system shifted below its smallest eigenvalue: with ``strict`` (EM's solves, whose matrix
    Σ r G + λ0 I is positive definite in exact arithmetic) conjugate gradients stop at the first direction of
    non-positive curvature with :class:`IndefinitePrecisionError` naming the block; without it (FedFisher's
    exact solve, which reports an unconverged residual as a warning) they run on and return."""
    from posterior_fusion.errors import IndefinitePrecisionError
    from posterior_fusion.fusion.layer_solve import solve_precision_sum

    gen = torch.Generator().manual_seed(5)
    d = TINY_LAYOUT.dim
    terms = [(1.0, random_curvature("kron", gen), torch.randn(d, generator=gen, dtype=torch.float64))]
    top = float(torch.linalg.eigvalsh(terms[0][1].blocks[0].to_dense().double())[-1])
    shifts = [-2.0 * top, 0.0, 0.0, 0.0]  # W1's system has only negative eigenvalues
    with pytest.raises(IndefinitePrecisionError, match=r"curvature block 0: .*not positive definite"):
        solve_precision_sum(terms, shift=shifts, strict=True)
    w, info = solve_precision_sum(terms, shift=shifts)  # not strict: runs (no math domain error either)
    assert info["iterations"] > 0 and w.shape == (d,)
    good, _ = solve_precision_sum(terms, shift=[0.5] * 4, strict=True, tolerance=1e-12)  # positive definite
    dense = torch.block_diag(*[b.to_dense() for b in terms[0][1].blocks]) + 0.5 * torch.eye(d, dtype=torch.float64)
    want = torch.linalg.solve(dense, (dense - 0.5 * torch.eye(d, dtype=torch.float64)) @ terms[0][2])
    torch.testing.assert_close(good, want, rtol=1e-8, atol=1e-8)
