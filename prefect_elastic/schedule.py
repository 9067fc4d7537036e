"""The training schedule: which samples every batch id stands for, and which batch ids every step trains.

Pure and deterministic for a job and its seed, so that any compute worker, in any generation, trains a
batch id on exactly the same samples, and step `s` always sums the same micro-batches. Owned by nobody:
the coordinator uses it to hand out work, data servers to cut batches, compute workers to find the data
server that holds a batch.

Batch ids of one epoch are dealt to the data servers in turn (batch `k` of an epoch lives on data server
`k % D`), so every step reads from every data server. Each data server shuffles its own partition once per
epoch with a generator seeded by (seed, epoch, server); samples that do not fill a whole batch on the
smallest partition are left out of that epoch, as `drop_last=True` does.

Where a source cannot be read at random cheaply (Parquet or Arrow on an object store), the shuffle goes by
blocks (`block_rows` > 0): a server's partition is cut into blocks of `block_rows` rows at multiples of
`block_rows` of the global index (a Parquet row group's rows, where the files were written with one size),
the blocks are put in a random order, and the samples are shuffled within each run of `window_blocks`
consecutive blocks of that order. A batch then reads from at most two runs (`2 * window_blocks` blocks), and
each block is read once an epoch where the reader keeps that many. The quality of that shuffle:
docs/guide.md, "Shuffling by blocks".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class BatchLocation:
    epoch: int
    server: int
    index: int  # position of the batch within its server's epoch


@dataclass(frozen=True)
class Schedule:
    partition_sizes: tuple[int, ...]
    batch_size: int
    micro_batches: int
    epochs: int
    seed: int
    block_rows: int = 0  # > 0: the shuffle goes by blocks of this many rows (above)
    window_blocks: int = 8  # the blocks whose samples are shuffled together

    def __post_init__(self) -> None:
        if self.batches_per_server_epoch < 1:
            raise ValueError(
                f"the smallest data partition ({min(self.partition_sizes)} samples) holds no whole batch of "
                f"{self.batch_size}; use a smaller batch_size or fewer data_servers"
            )

    @property
    def data_servers(self) -> int:
        return len(self.partition_sizes)

    @property
    def batches_per_server_epoch(self) -> int:
        return min(self.partition_sizes) // self.batch_size

    @property
    def batches_per_epoch(self) -> int:
        return self.data_servers * self.batches_per_server_epoch

    @property
    def total_batches(self) -> int:
        return self.epochs * self.batches_per_epoch

    @property
    def total_steps(self) -> int:
        return math.ceil(self.total_batches / self.micro_batches)

    def step_batches(self, step: int) -> range:
        """Batch ids trained by `step`; the last step may hold fewer than `micro_batches`."""
        if not 0 <= step < self.total_steps:
            raise IndexError(f"step {step} is outside the schedule (0..{self.total_steps - 1})")
        start = step * self.micro_batches
        return range(start, min(start + self.micro_batches, self.total_batches))

    def share(self, step: int, rank: int, size: int) -> tuple[int, ...]:
        """The batch ids of `step` that the worker of rank `rank` of `size` trains (roles by rank):
        micro-batch `j` of the step goes to rank `j % size`, so shares differ by at most one and a rank
        beyond the step's micro-batches has none."""
        if not 0 <= rank < size:
            raise IndexError(f"rank {rank} is outside a membership of {size}")
        return tuple(self.step_batches(step)[rank::size])

    def share_after(self, step: int, rank: int, size: int) -> tuple[int, ...]:
        """The share of the step after `step` (`share`), none past the last step."""
        return self.share(step + 1, rank, size) if step + 1 < self.total_steps else ()

    def step_of(self, batch_id: int) -> int:
        return batch_id // self.micro_batches

    def locate(self, batch_id: int) -> BatchLocation:
        if not 0 <= batch_id < self.total_batches:
            raise IndexError(f"batch id {batch_id} is outside the schedule (0..{self.total_batches - 1})")
        epoch, k = divmod(batch_id, self.batches_per_epoch)
        index, server = divmod(k, self.data_servers)
        return BatchLocation(epoch=epoch, server=server, index=index)

    def server_of(self, batch_id: int) -> int:
        return self.locate(batch_id).server

    def partition_start(self, server: int) -> int:
        """The global index of data server `server`'s first sample (the partitions are contiguous)."""
        return sum(self.partition_sizes[:server])

    def sample_indices(self, batch_id: int) -> np.ndarray:
        """Indices into the data server's own partition of the samples of `batch_id`."""
        where = self.locate(batch_id)
        order = _epoch_order(
            self.seed,
            where.epoch,
            where.server,
            self.partition_sizes[where.server],
            self.partition_start(where.server),
            self.block_rows,
            self.window_blocks,
        )
        return order[where.index * self.batch_size : (where.index + 1) * self.batch_size]

    def samples(self, batch_id: int) -> tuple[int, np.ndarray]:
        """The epoch of `batch_id` and the global indices of its samples, in the batch's order."""
        where = self.locate(batch_id)
        return where.epoch, self.sample_indices(batch_id) + self.partition_start(where.server)

    def server_batches_after(self, batch_id: int, count: int) -> list[int]:
        """The next `count` batch ids (at most) that live on the data server of `batch_id`, in order."""
        step = self.data_servers  # (an epoch's batch ids are dealt to the servers in turn)
        return [
            b for b in range(batch_id + step, batch_id + step * (count + 1), step) if b < self.total_batches
        ]


@lru_cache(maxsize=8)
def _epoch_order(
    seed: int, epoch: int, server: int, size: int, start: int = 0, block_rows: int = 0, window: int = 8
) -> np.ndarray:
    rng = np.random.default_rng([seed, epoch, server])
    if block_rows <= 0:
        order = rng.permutation(size)
    else:
        # Block edges at multiples of `block_rows` of the global index, in the partition's own index.
        edges = [
            0,
            *range(block_rows - start % block_rows if start % block_rows else block_rows, size, block_rows),
            size,
        ]
        blocks = [np.arange(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]
        placed = rng.permutation(len(blocks))
        runs = [
            rng.permutation(np.concatenate([blocks[k] for k in placed[w : w + max(1, window)]]))
            for w in range(0, len(blocks), max(1, window))
        ]
        order = np.concatenate(runs)
    order.setflags(write=False)
    return order
