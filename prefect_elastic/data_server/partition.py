"""A data server's partition of the training data, served by batch id and read ahead of the steps.

Nothing of the partition is read when the data server starts: the schedule says which batch ids live here
and in which order the steps ask for them, so after serving batch `b` the data server makes the next
`prefetch` batches of its own in a reader thread (`BatchMaker.make`), and a step finds its batch made. Its
memory is those batches and the source's cache of blocks (`data_cache_bytes`), whatever the dataset's size.
A batch asked again (a step trained again after a loss) is made again, with the same bits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict

from ..data.batches import BatchMaker, BatchSpec
from ..data.fields import Batch
from ..dataset import partition_bounds
from ..errors import FatalError
from .state import ShardState


class Partition:
    """Samples `[start, stop)` of the dataset: data server `index`'s of the schedule's `data_servers`."""

    def __init__(self, index: int, batches: BatchSpec, shard: ShardState) -> None:
        self.index = index
        self._schedule = batches.schedule
        self._shard = shard  # (for the generation a call must be of)
        self.start, self.stop = partition_bounds(batches.source.length, self._schedule.data_servers, index)
        self._spec = batches
        self._maker: BatchMaker | None = (
            None  # (opened on first use: a data server that serves none opens none)
        )
        self._prefetch = batches.prefetch
        # One reader thread: the source's blocks and the user's code are read by one thread at a time.
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefect-elastic-reader")
        self._ahead: OrderedDict[int, concurrent.futures.Future[Batch]] = OrderedDict()
        self.made = 0  # batches made (read ahead or asked), for the report
        self.peak_bytes = 0  # the most bytes of batches made and not yet served

    async def get_batch(self, generation: int, batch_id: int) -> Batch:
        self._shard.check(generation, "get_batch")
        if self._schedule.server_of(batch_id) != self.index:
            raise FatalError(f"batch {batch_id} lives on data server {self._schedule.server_of(batch_id)}")
        made = self._ahead.pop(batch_id, None) or self._reader.submit(self._make, batch_id)
        for b in self._schedule.server_batches_after(batch_id, self._prefetch):
            if b not in self._ahead:
                self._ahead[b] = self._reader.submit(self._make, b)
        while len(self._ahead) > 2 * max(1, self._prefetch):
            _, dropped = self._ahead.popitem(last=False)  # (read ahead for steps that did not come)
            dropped.cancel()
        self.peak_bytes = max(self.peak_bytes, self._bytes_ahead())
        return await asyncio.wrap_future(made)

    def _make(self, batch_id: int) -> Batch:
        if self._maker is None:
            self._maker = BatchMaker(self._spec)
        self.made += 1
        return self._maker.make(batch_id)

    def _bytes_ahead(self) -> int:
        total = 0
        for future in self._ahead.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                total += sum(t.numel() * t.element_size() for t in future.result().values())
        return total

    def close(self) -> None:
        for future in self._ahead.values():
            future.cancel()
        self._ahead.clear()
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self._maker is not None:
            self._maker.close()

    @property
    def samples(self) -> int:
        return self.stop - self.start
