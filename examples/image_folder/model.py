"""A small CNN for data.py's crops (3 x 12 x 12) of make_images.py's four classes."""

from __future__ import annotations

from torch import nn

CLASSES = 4


def small_cnn(channels: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 12 -> 6
        nn.Conv2d(channels, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, CLASSES),
    )
