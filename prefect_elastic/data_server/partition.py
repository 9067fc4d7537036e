"""A data server's partition of the training data, read once as it starts, served by batch id."""

from __future__ import annotations

import torch

from ..dataset import DatasetInfo, load_partition, partition_bounds
from ..errors import FatalError
from ..schedule import Schedule
from .state import ShardState


class Partition:
    """Samples `[start, stop)` of the dataset: data server `index`'s of the schedule's `data_servers`."""

    def __init__(self, index: int, dataset: DatasetInfo, schedule: Schedule, shard: ShardState) -> None:
        self.index = index
        self._schedule = schedule
        self._shard = shard  # (for the generation a call must be of)
        self.start, self.stop = partition_bounds(dataset.total, schedule.data_servers, index)
        x, y = load_partition(dataset, self.start, self.stop)
        self.x = torch.from_numpy(x)
        self.y = torch.from_numpy(y)

    async def get_batch(self, generation: int, batch_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._shard.check(generation, "get_batch")
        if self._schedule.server_of(batch_id) != self.index:
            raise FatalError(f"batch {batch_id} lives on data server {self._schedule.server_of(batch_id)}")
        idx = torch.tensor(self._schedule.sample_indices(batch_id))  # (a copy: the order is read-only)
        return self.x[idx], self.y[idx]

    @property
    def nbytes(self) -> int:
        return self.x.numel() * self.x.element_size() + self.y.numel() * self.y.element_size()
