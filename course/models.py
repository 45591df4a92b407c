"""The models the lessons train.

- :func:`lenet` / :func:`lenet_params`: the LeNet of the "data parallel from scratch" lesson,
  written as a plain function of a parameter list so that each device can hold its own copy.
- :func:`resnet18`: a ResNet-18 for small (28x28 or 32x32) images, as in *Dive into Deep
  Learning*: big enough that splitting a batch over GPUs pays off.
- :func:`mlp`: a small ``nn.Sequential`` for the distributed lessons and checks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Cross-entropy per example; the data-parallel code sums it per shard.
loss = nn.CrossEntropyLoss(reduction="none")


def lenet_params(scale: float = 0.01, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Fresh LeNet parameters ``[W1, b1, W2, b2, W3, b3, W4, b4]`` for 1x28x28 inputs."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator) * scale

    return [
        randn(20, 1, 3, 3), torch.zeros(20),
        randn(50, 20, 5, 5), torch.zeros(50),
        randn(800, 128), torch.zeros(128),
        randn(128, 10), torch.zeros(10),
    ]


def lenet(X: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """LeNet forward pass: two conv + average-pool blocks, then two fully connected layers."""
    h1 = F.avg_pool2d(F.relu(F.conv2d(X, params[0], params[1])), kernel_size=2, stride=2)
    h2 = F.avg_pool2d(F.relu(F.conv2d(h1, params[2], params[3])), kernel_size=2, stride=2)
    h2 = h2.reshape(h2.shape[0], -1)
    h3 = F.relu(h2 @ params[4] + params[5])
    return h3 @ params[6] + params[7]


def sgd(params: list[torch.Tensor], lr: float, batch_size: int) -> None:
    """Minibatch SGD on summed losses: ``param -= lr * grad / batch_size``, then zero grads."""
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad.zero_()


class Residual(nn.Module):
    """The ResNet basic block: two 3x3 convolutions with a shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride=stride)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


def resnet18(num_classes: int = 10, in_channels: int = 1) -> nn.Module:
    """ResNet-18 for small images: a 3x3 stem without max-pooling, four stages, global pooling."""
    def stage(cin, cout, first):
        return nn.Sequential(Residual(cin, cout, stride=1 if first else 2), Residual(cout, cout))

    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        stage(64, 64, True), stage(64, 128, False), stage(128, 256, False), stage(256, 512, False),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes),
    )


def mlp(sizes=(32, 64, 64, 10)) -> nn.Sequential:
    """Linear/ReLU layers of the given widths: small, deterministic, quick on a CPU."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)
