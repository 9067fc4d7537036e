"""The seed of a sample's random draws, and the global generators seeded for a while (`seeded_sample`):
what a user's Dataset draws while one sample is read, or while it is built (`factory_source`), depends on
that seed alone, whatever the process drew before, and what it draws after is as it would have been."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["sample_seed", "seeded_sample"]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of the random draws made while sample `index` of epoch `epoch` is read: a function of the
    three only (mixed, so that neighbouring samples or epochs do not get neighbouring seeds)."""
    return int(np.random.SeedSequence([seed % 2**64, epoch, index]).generate_state(1, np.uint64)[0] >> 1)


@contextlib.contextmanager
def seeded_sample(seed: int) -> Iterator[None]:
    """torch's, NumPy's legacy and Python's global generators seeded with `seed` inside, and put back as
    they were after: what a sample's `__getitem__` draws does not depend on what this process drew before,
    nor changes what it draws next."""
    torch_state = torch.random.default_generator.get_state()
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    try:
        torch.random.default_generator.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        yield
    finally:
        torch.random.default_generator.set_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
