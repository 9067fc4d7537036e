"""Dataset factories for the tests of the sources (`tests.sources_factories:NAME` as a dataset setting):
good ones, of tuple and dict items, and one of each way a factory can be wrong."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

SIZE = 12


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Tuple items: a float32 input of shape (3,) and an int64 label."""

    def __init__(self, size: int = SIZE) -> None:
        self.x = torch.arange(size * 3, dtype=torch.float32).reshape(size, 3)
        self.y = torch.arange(size, dtype=torch.int64) % 4

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Named(Dataset[dict[str, Any]]):
    """Dict items of a numpy array, a Python float and a numpy int."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"pixels": np.full((2, 2), i, dtype=np.uint8), "weight": 0.5 * i, "label": np.int64(i % 3)}


class Drawn(Dataset[tuple[torch.Tensor, int]]):
    """Data drawn from the global generators when it is built (as a random split or synthetic data is)."""

    def __init__(self) -> None:
        self.x = torch.randn(SIZE, 2)
        self.offset = random.random()

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i] + self.offset, i


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


class NoLength(Dataset[int]):
    def __getitem__(self, i: int) -> int:
        return i


class Empty(Pairs):
    def __init__(self) -> None:
        super().__init__(0)


class Lone(Pairs):
    def __getitem__(self, i: int) -> Any:
        return self.x[i]


class Broken(Pairs):
    def __getitem__(self, i: int) -> Any:
        raise RuntimeError("the image file is truncated")


# The bad sample of the datasets that fail only while training: deep in the dataset, so that the job's
# check of its first batch's first samples passes (`prepare.batch_spec`), and it is found in a later step.
BAD_SAMPLE = 37
LONG = 64


class Truncated(Pairs):
    """64 good samples but one, whose `__getitem__` raises (as a truncated image's decode does)."""

    def __init__(self) -> None:
        super().__init__(LONG)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == BAD_SAMPLE:
            raise OSError(f"image file is truncated (sample {i})")
        return super().__getitem__(i)


class MisShapen(Pairs):
    """64 samples, one of whose inputs has 4 values where its neighbours have 3: torch's collate cannot
    stack it."""

    def __init__(self) -> None:
        super().__init__(LONG)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        return (torch.zeros(4) if i == BAD_SAMPLE else x), y


class Worded(Pairs):
    """64 samples, one of whose labels is a string (a label file read wrong)."""

    def __init__(self) -> None:
        super().__init__(LONG)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
        x, y = super().__getitem__(i)
        return x, ("cat" if i == BAD_SAMPLE else y)


def pairs() -> Pairs:
    return Pairs()


def truncated() -> Truncated:
    return Truncated()


def mis_shapen() -> MisShapen:
    return MisShapen()


def worded() -> Worded:
    return Worded()


def pairs_classifier() -> torch.nn.Module:
    """A model for `Pairs`' items: 3 inputs, 4 classes (cross entropy on the int64 labels)."""
    return torch.nn.Linear(3, 4)


def named() -> Named:
    return Named()


def drawn() -> Drawn:
    return Drawn()


def raises() -> Pairs:
    raise FileNotFoundError("no such folder: /data/images")


def a_number() -> int:
    return 7


def stream() -> Stream:
    return Stream()


def no_length() -> NoLength:
    return NoLength()


def empty() -> Empty:
    return Empty()


def lone() -> Lone:
    return Lone()


def broken() -> Broken:
    return Broken()


class Factories:
    """A factory named by a dotted path (`Factories.pairs`)."""

    pairs = staticmethod(pairs)
