"""The pieces the image workloads (`workloads.py`) and the text classifier (`text_model.py`) are both built
from: a Hugging Face classifier as a plain module, and a dataset written to a file once. They live here so
that `workloads` imports `text_model` and never the other way round."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn


class Logits(nn.Module):
    """A Hugging Face classifier as a plain module: its input (the keyword `takes`: `pixel_values` for
    images, `input_ids` for token ids) in, logits out, so that the job's loss (`cross_entropy` of the output
    and the labels) applies to it as to any other model."""

    def __init__(self, classifier: nn.Module, takes: str = "pixel_values") -> None:
        super().__init__()
        self.classifier = classifier
        self.takes = takes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(**{self.takes: x}).logits
        return logits


def write_once(path: str | Path, make: Callable[[], tuple[np.ndarray, np.ndarray]]) -> str:
    """`make()`'s arrays written to `path` as one .npz (`x`, `y`) unless it exists (whole or not at all:
    through a temporary file); its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        x, y = make()
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, x=x, y=y)
        tmp.rename(path)
    return str(path)
