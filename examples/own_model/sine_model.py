"""A model of your own: a small regressor of y = sin(x) from one input, with the mean squared error.

Any `torch.nn.Module` works the same way: the job names a callable that returns the model
(`model: sine_model:sine_mlp`), and every process that trains builds it from that import path.
"""

from __future__ import annotations

from torch import nn


def sine_mlp(hidden: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
    )
