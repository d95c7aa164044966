"""``posterior_fusion/local/train.py``: the optimisers of ``fit-local`` (momentum SGD, Adam, AdamW), their
schedule and clipping. Every optimiser minimises the mean cross-entropy plus the prior's pull; Adam with the pull
in its gradient stops at the posterior's mode — checked on a convex model against the objective's own gradient."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posterior_fusion.errors import ConfigError
from posterior_fusion.local.fit_config import TrainConfig, fit_config_from
from posterior_fusion.local.train import learning_rate_factor, train_map
from posterior_fusion.models import ModelSpec


def _objective_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, wd: float) -> torch.Tensor:
    """∇ [mean CE + ½ wd ‖w‖²] in float64, the objective whose minimum is the MAP the capture describes."""
    model = model.double()
    loss = nn.functional.cross_entropy(model(x.double()), y) + 0.5 * wd * sum(p.square().sum() for p in model.parameters())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("schedule, warmup, clip", [("constant", 0.0, None), ("cosine", 2.0, 5.0)])
def test_adam_stops_at_the_map_of_a_convex_model(schedule, warmup, clip):
    """Softmax regression (convex), full batches: Adam, with a schedule, warm-up and clipping or without, ends
    where the objective's gradient vanishes; the same for SGD."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)
    wd = 0.05
    for optimizer, lr, epochs in (("adam", 0.05, 1500), ("sgd", 0.5, 1500)):
        torch.manual_seed(0)
        model = nn.Linear(5, 3)
        cfg = TrainConfig(epochs=epochs, batch_size=200, optimizer=optimizer, lr=lr, momentum=0.9, weight_decay=wd,
                          schedule=schedule if optimizer == "adam" else "constant", warmup_epochs=warmup, grad_clip=clip)
        train_map(model, x, y, cfg, seed=0)
        assert _objective_gradient(model, x, y, wd).norm() < 1e-3, optimizer


def test_adamw_pulls_toward_the_prior_decoupled():
    """AdamW's decay is applied to the weights, not through Adam's normalisation: with no data gradient (a zero
    learning signal) each step shrinks the weights by exactly lr · wd."""
    model = nn.Linear(3, 2, bias=False)
    before = model.weight.detach().clone()
    x, y = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)  # zero inputs: the weight's gradient is 0
    cfg = TrainConfig(epochs=1, batch_size=4, optimizer="adamw", lr=0.1, weight_decay=0.5)
    train_map(model, x, y, cfg, seed=0)
    torch.testing.assert_close(model.weight.detach(), before * (1 - 0.1 * 0.5))


def test_a_small_transformer_learns_with_adam_where_sgd_at_its_defaults_does_not():
    """A synthetic sequence task (which half holds the largest first feature, and the sign of the second's sum):
    the built-in transformer reaches a training accuracy Adam's users expect; momentum SGD at its defaults stays
    far below it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1, 8, 8, generator=g)
    y = (x[:, 0, :, 0].argmax(1) >= 4).long() * 2 + (x[:, 0, :, 1].sum(1) > 0).long()
    spec = ModelSpec("transformer", {"num_classes": 4, "row_size": 8, "width": 16, "layers": 1, "heads": 2})
    accuracy = {}
    for optimizer, lr in (("sgd", TrainConfig().lr), ("adam", 1e-2)):
        torch.manual_seed(0)
        model = spec.build()
        train_map(model, x, y, TrainConfig(epochs=40, batch_size=32, optimizer=optimizer, lr=lr, weight_decay=1e-4),
                  seed=0)
        with torch.no_grad():
            accuracy[optimizer] = float((model.eval()(x).argmax(1) == y).float().mean())
    assert accuracy["adam"] >= 0.75 and accuracy["adam"] - accuracy["sgd"] >= 0.1, accuracy


def test_the_schedule_and_the_settings_refuse_bad_values():
    assert learning_rate_factor(0, 100, 10, "constant") == pytest.approx(0.1)
    assert learning_rate_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert learning_rate_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert learning_rate_factor(99, 100, 0, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.99)))
    for bad in ({"optimizer": "lbfgs"}, {"schedule": "step"}, {"grad_clip": -1.0}, {"warmup_epochs": -1.0}):
        with pytest.raises(ConfigError):
            fit_config_from(bad)
    # the defaults leave the fit's fingerprint (the experiment caches' key) as it was
    assert "optimizer" not in fit_config_from({}).fingerprint_dict()["train"]
    assert fit_config_from({"optimizer": "adam"}).fingerprint_dict()["train"]["optimizer"] == "adam"
