"""The fast capture whatever the model does in place (``posterior_fusion/models/jacobians.py``): a
``ReLU(inplace=True)`` or an ``out += identity`` after a captured layer overwrites that layer's output tensor
(and its successor's input) after the layer ran; the curvature must still be that of the layer's own output —
against a dense float64 GGN, and against the same model written without in-place operations."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import dense_ggn_diagonal
from torch import nn

from posterior_fusion.local.capture import capture


class Block(nn.Module):
    """A torchvision-style basic block: conv → BatchNorm → ReLU(inplace) → conv, ``out += identity``, ReLU."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2)
        self.relu, self.inplace = nn.ReLU(inplace=inplace), inplace
        self.fc = nn.Linear(2 * 16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            out += x
        else:
            out = out + x
        return self.fc(self.relu(out).flatten(1))


def mlp(inplace: bool) -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.ReLU(inplace=inplace), nn.Linear(4, 3))


def _pair(kind: str):
    torch.manual_seed(0)
    if kind == "mlp":
        model, x = mlp(True), torch.randn(24, 5)
        plain = mlp(False)
    else:
        model, x = Block(True), torch.randn(24, 2, 4, 4)
        for bn in (model.bn1, model.bn2):  # statistics that are not (0, 1), used in evaluation mode
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        plain = Block(False)
    plain.load_state_dict(model.state_dict())
    return model.eval(), plain.eval(), x, torch.randint(0, 3, (24,))


def _dense(curv) -> torch.Tensor:
    return curv.to_dense() if hasattr(curv, "to_dense") else torch.block_diag(*[b.to_dense() for b in curv.blocks])


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_the_diagonal_of_a_model_with_in_place_operations_is_the_dense_ggn(kind):
    model, _, x, y = _pair(kind)
    ref = dense_ggn_diagonal(copy.deepcopy(model).double(), x.double())
    curv, by = capture("diag", model, x, y, 8, "exact", "fast", None, lambda m: None)
    assert by == "fast"
    got = _dense(curv).diagonal().double()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("kind", ["mlp", "block"])
@pytest.mark.parametrize("structure, kfac, ggn", [("kron", "expand", "exact"), ("kron", "reduce", "exact"),
                                                  ("kron", "expand", "mc"), ("kron", "reduce", "mc"),
                                                  ("diag+full", "expand", "exact")])
def test_in_place_operations_change_no_factor(kind, structure, kfac, ggn):
    """Every block equals the capture of the same model written without in-place operations (whose capture
    the curvlinops tests check), drawing the same MC labels."""
    model, plain, x, y = _pair(kind)
    got, _ = capture(structure, model, x, y, 8, ggn, "fast", torch.Generator().manual_seed(1), lambda m: None, kfac)
    want, _ = capture(structure, plain, x, y, 8, ggn, "fast", torch.Generator().manual_seed(1), lambda m: None, kfac)
    a, b = _dense(got).double(), _dense(want).double()
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-7 * float(b.abs().max()))
    assert float(a.abs().max()) > 0


def test_a_numerically_zero_block_of_a_trained_layer_warns():
    """A layer whose output the loss ignores (its output multiplied by zero) has a zero K-FAC output factor: the
    fit says so in one warning naming it, rather than listing it as curvature."""
    from posterior_fusion.local.fit_checks import vanishing_blocks

    class Ignored(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.ignored = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x) + 0.0 * self.ignored(x)

    torch.manual_seed(0)
    model, x = Ignored().eval(), torch.randn(16, 4)
    curv, _ = capture("kron", model, x, torch.randint(0, 3, (16,)), 8, "exact", "fast", None, lambda m: None)
    assert vanishing_blocks(model, curv, "kron", "expand") == ["ignored.weight", "ignored.bias"]
