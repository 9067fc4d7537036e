"""The seed of a sample's random draws, and the global generators seeded for a while (`seeded_sample`):
what a user's Dataset draws while one sample is read, or while it is built (`factory_source`), depends on
that seed alone, whatever the process drew before, and what it draws after is as it would have been."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["GLOBAL_RNG_LOCK", "sample_seed", "seeded_sample"]

# Held by whatever seeds torch's one global generator and draws from it: a model's construction
# (`ModelSpec.initial_model`), a micro-batch's forward (`compute.MicroBatchTrainer.gradient`), a sample
# read or a Dataset built (`seeded_sample`). A data server's reader thread reads samples while its event
# loop's thread may build another job's model: a seed set by one between another's seed and its draws
# changes the other's draws (a random crop that depended on timing, seen as batches that differed).
GLOBAL_RNG_LOCK = threading.Lock()


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of the random draws made while sample `index` of epoch `epoch` is read: a function of the
    three only (mixed, so that neighbouring samples or epochs do not get neighbouring seeds)."""
    return int(np.random.SeedSequence([seed % 2**64, epoch, index]).generate_state(1, np.uint64)[0] >> 1)


@contextlib.contextmanager
def seeded_sample(seed: int) -> Iterator[None]:
    """torch's, NumPy's legacy and Python's global generators seeded with `seed` inside, and put back as
    they were after: what a sample's `__getitem__` draws does not depend on what this process drew before,
    nor changes what it draws next. Under `GLOBAL_RNG_LOCK`: no other thread draws meanwhile."""
    with GLOBAL_RNG_LOCK, _seeded(seed):
        yield


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
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
