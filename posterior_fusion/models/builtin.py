"""Built-in architectures (the FedBEns LeNet and CNN, a configurable MLP, a ResNet-20-style network, a
small transformer built from stock PyTorch layers)."""

from __future__ import annotations

import math

import torch
from torch import nn


def lenet(num_classes: int = 10, in_channels: int = 1, bias: bool = False, width: int = 1) -> nn.Sequential:
    """FedBEns LeNet for 28x28 inputs: conv(1->6,5) pool conv(6->16,5) pool fc 256->120->84->C, every layer's
    width times ``width`` (1: the paper's network).

    Without biases (the paper's default) it has 44,190 parameters at ``width`` 1.
    """
    if not 1 <= width <= 64:
        raise ValueError(f"lenet width must be 1 to 64, got {width}")
    c1, c2, h1, h2 = 6 * width, 16 * width, 120 * width, 84 * width
    return nn.Sequential(
        nn.Conv2d(in_channels, c1, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * c2, h1, bias=bias), nn.ReLU(),
        nn.Linear(h1, h2, bias=bias), nn.ReLU(),
        nn.Linear(h2, num_classes, bias=bias),
    )


def cnn(num_classes: int = 10, in_channels: int = 3, bias: bool = False) -> nn.Sequential:
    """The paper's SVHN/CIFAR10 CNN for 32x32 inputs: conv(3->32,5) conv(32->64,5) fc 1600->512->128->C."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1600, 512, bias=bias), nn.ReLU(),
        nn.Linear(512, 128, bias=bias), nn.ReLU(),
        nn.Linear(128, num_classes, bias=bias),
    )


def mlp(num_classes: int = 10, in_features: int = 784, hidden: int = 32, bias: bool = True,
        hidden_sizes: list[int] | None = None) -> nn.Sequential:
    """A perceptron on flattened inputs: one hidden layer of ``hidden`` units, or the layers
    ``hidden_sizes`` (e.g. ``[64, 32]``; ``[]`` = logistic regression). Suits tabular data."""
    sizes = [hidden] if hidden_sizes is None else list(hidden_sizes)
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in sizes:
        layers += [nn.Linear(width, h, bias=bias), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes, bias=bias))
    return nn.Sequential(*layers)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()

        def normal(c: int) -> nn.Module:
            if norm == "batch":
                return nn.BatchNorm2d(c)
            return nn.GroupNorm(min(8, c), c) if norm == "group" else nn.Identity()

        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = normal(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = normal(cout)
        self.short = (nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.relu(self.n1(self.conv1(x)))
        return self.relu(self.n2(self.conv2(out)) + self.short(x))


class ResNet20(nn.Module):
    """ResNet-20-style network for 32x32 colour images (3 stages of 3 basic blocks, widths
    w, 2w, 4w): ``norm="none"`` (every parameter is a conv or linear weight, so K-FAC capture
    applies), ``"group"`` (GroupNorm) or ``"batch"`` (BatchNorm: fine-tuned from a pretrained base its
    statistics stay frozen, ``models/finetune.py``; from random starting points each silo folds its own into
    the affine parameters, ``models/batchnorm.py``)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 16, norm: str = "none") -> None:
        super().__init__()
        if norm not in ("none", "group", "batch"):
            raise ValueError("norm must be 'none', 'group' or 'batch'")
        self.stem = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        blocks, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for b in range(3):
                blocks.append(_Block(cin, cout, 2 if stage and b == 0 else 1, norm))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(self.flatten(self.pool(self.blocks(nn.functional.relu(self.stem(x))))))


def resnet20(num_classes: int = 10, in_channels: int = 3, width: int = 16, norm: str = "none") -> ResNet20:
    return ResNet20(num_classes, in_channels, width, norm)


class RowTransformer(nn.Module):
    """A transformer classifier from stock PyTorch layers on images read row by row: each of the H rows
    (its W·C values) is a token, embedded by an ``nn.Linear``, plus fixed sinusoidal positions (a
    non-persistent buffer, not a parameter), then ``layers`` ``nn.TransformerEncoderLayer`` (batch first,
    ``heads`` heads, feed-forward 2·width, no dropout), ``nn.LayerNorm``, the tokens' mean and a linear head."""

    def __init__(self, num_classes: int, in_channels: int, row_size: int, width: int, layers: int, heads: int,
                 max_rows: int = 256) -> None:
        super().__init__()
        if width % heads:
            raise ValueError("width must be a multiple of heads")
        self.embed = nn.Linear(row_size * in_channels, width)
        position = torch.arange(max_rows, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
        table = torch.zeros(max_rows, width)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * freq), torch.cos(position * freq[: width // 2])
        self.register_buffer("positions", table, persistent=False)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True), layers,
            enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:  # (N, C, H, W) -> H tokens of W·C values
            x = x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1)
        h = self.embed(x) + self.positions[: x.shape[1]]
        return self.head(self.norm(self.encoder(h)).mean(1))


def transformer(num_classes: int = 10, in_channels: int = 1, row_size: int = 28, width: int = 64, layers: int = 2,
                heads: int = 4) -> RowTransformer:
    return RowTransformer(num_classes, in_channels, row_size, width, layers, heads)
