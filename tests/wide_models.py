"""A model with one layer far over a data server's share (65,536 of its 76,810 elements), for the tests of
tensors split across data servers (`sharding.plan_pieces`). Gated and paced as `tests.models`' are, so
that tests can hold training and kill a worker mid-run; neither changes a bit of the result."""

from __future__ import annotations

import time

import torch
from torch import nn

from .models import _wait_at_gate


class _GatedWideMlp(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _wait_at_gate()
        time.sleep(0.004)
        return super().forward(x)


def wide_mlp() -> nn.Module:
    return _GatedWideMlp(nn.Flatten(), nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10))
