"""Starts that end on one mode become one member, weighted by their share of the starts."""

from __future__ import annotations

import torch

MERGE_TOLERANCE = 1e-5  # rows within this relative distance of an earlier one are the same mode


def coinciding_rows(W: torch.Tensor, keys: list[int], tolerance: float) -> list[list[int]]:
    """Rows of ``W`` ``(K, d)`` that are one mode: groups (in row order, each led by its first row) of rows with
    the same ``keys`` entry (the objective a row was optimised against: its prior centre's component index)
    within ``tolerance`` of the group's first row, relative to the larger norm. EM's stationary point does not
    depend on the start (measured: every start of one component index reaches the same point to ≈ 1e-8), so
    several starts can end on one mode; a row joins the first group it fits.

    No float64 copy of ``W`` (at C·M = 200 rows of a width-64 ResNet it would be 7 GB): norms are accumulated
    in float64 row by row, the difference of two close float32 rows is exact, and rows whose norms differ by more
    than the tolerance (most distinct rows) are told apart without forming it (``|‖a‖ − ‖b‖| ≤ ‖a − b‖``)."""
    norms = [float(torch.linalg.vector_norm(w, dtype=torch.float64)) for w in W.detach()]
    groups: list[list[int]] = []
    for k in range(W.shape[0]):
        for g in groups:
            j = g[0]
            limit = tolerance * max(norms[j], norms[k])
            if (keys[j] == keys[k] and abs(norms[j] - norms[k]) <= limit
                    and float(torch.linalg.vector_norm(W[k].detach() - W[j].detach(), dtype=torch.float64)) <= limit):
                g.append(k)
                break
        else:
            groups.append([k])
    return groups


def merge_coinciding(best: torch.Tensor, keys: list[int]) -> tuple[list[list[int]], torch.Tensor]:
    """The groups of coinciding rows of ``best`` ``(K, d)`` (:func:`coinciding_rows` at
    :data:`MERGE_TOLERANCE`) and each group's share of the starts ``(K',)`` float64."""
    groups = coinciding_rows(best, keys, MERGE_TOLERANCE)
    share = torch.tensor([len(g) for g in groups], dtype=torch.float64) / len(keys)
    return groups, share
