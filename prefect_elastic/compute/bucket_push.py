"""A sync step's gradients leaving bucket by bucket during backward (`ElasticJob.overlap_push`).

`BucketPush` arms the backward hooks (`buckets.BucketHooks`) on the step's parameters; each bucket whose
gradients are all in goes to its shard as a quiet frame (a `Part`: the generation, the step, the batch
id, the bucket and every bucket's range of the shard's flat parameters), written by the link's sender
thread (`outbox.Outbox`) while backward goes on. The shard sums the parts in batch-id order as they come
(`data_server/bucketed.py`). The step's push to each shard then carries no gradient: it seals the share's
micro-batches (their losses and buffers, as before), and leaves only once every part is written (`drain`),
so a shard never holds every seal of a step while another still misses a part (the step stays atomic
across shards: docs/design/overlapped-step.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..data_server.bucket_plan import Bucket, plan_buckets
from ..sharding import Piece
from ..wire import Entry, Frame, Part, ShardLink
from .buckets import BucketHooks
from .outbox import Outbox

# Where `overlap_push` is left to the engine, a model of this many bytes of parameters or more sends its
# gradients during backward. Measured side by side (docs/benchmarks.md, one worker): the 45 MB ResNet-18's
# fixed cost a step went from 37.5 to 21.7 ms, while models of 3 MB and less paid 0.6 to 1.2 ms more a
# step for the extra frames and the sender thread than the overlap saved.
OVERLAP_MIN_BYTES = 16 * 2**20


def cores_short(
    machines: Mapping[str, str],
    cores: Mapping[str, float],
    data_servers: Sequence[str],
    loops: Sequence[str],
    loop_threads: int,
) -> list[str]:
    """The machines where compute loops and data servers holding parameters run together on fewer cores than
    they want: each loop its `loop_threads` torch threads, each data server one. There the overlapped step
    costs more than it saves: it moves the shards' sums and updates under backward, onto the cores
    backward runs on (the ResNet-18's backward went from 103-107 ms to 125-131 on 2 cores), while a whole
    push there crosses through shared memory and is applied in place, each shard on its own core
    (docs/benchmarks.md, "Gradients that leave during backward"). `machines`: each worker's machine
    (`cluster.machines`); `cores`: the cores each machine's workers may use together
    (`cluster.machine_cores`: their CPU sets and cgroup quotas; a machine not in it is not counted)."""
    wanted = cores_wanted(machines, data_servers, loops, loop_threads)
    both = {machines[worker] for worker in data_servers} & {machines[worker] for worker in loops}
    return sorted(machine for machine in both if machine in cores and wanted[machine] > cores[machine])


def cores_wanted(
    machines: Mapping[str, str], data_servers: Sequence[str], loops: Sequence[str], loop_threads: int
) -> dict[str, int]:
    """The cores each machine's compute loops (`loop_threads` each) and data servers (one each) want."""
    wanted: dict[str, int] = {}
    for worker in loops:
        wanted[machines[worker]] = wanted.get(machines[worker], 0) + loop_threads
    for worker in data_servers:
        wanted[machines[worker]] = wanted.get(machines[worker], 0) + 1
    return wanted


class BucketPush:
    """The parts of one compute loop's steps: `plan`, every shard's buckets (`plan_buckets`)."""

    def __init__(self, plan: list[list[Bucket]]) -> None:
        self.plan = plan
        self.bounds = [[[b.start, b.stop] for b in buckets] for buckets in plan]
        self.gets_parts = [bool(buckets) for buckets in plan]  # (a shard without parameters gets seals only)
        self._links: list[ShardLink] = []
        self._outbox: Outbox[Frame] | None = None
        self._step = (-1, -1)  # (generation, step) of the parts being sent
        self._backup = False  # whether that step's share is a backup of another member's ids
        self._batch = -1

    def start(
        self,
        links: list[ShardLink],
        generation: int,
        step: int,
        leaves: Mapping[str, torch.Tensor],
        backup: bool = False,
    ) -> BucketHooks:
        """Arm the hooks on the step's `leaves` (the parameters gradients are taken of); `links`: the
        connections to the shards, in shard order; `backup`: the share trained is a backup of another
        member's ids, and its parts say so (a shard that asked for that backup takes only those:
        docs/design/overlapped-step.md, "A straggler reading in place")."""
        self._links = links
        if self._outbox is None:
            self._outbox = Outbox([self._writer(i) for i in range(len(self.plan))], name="bucket-push")
        self._step = (generation, step)
        self._backup = backup
        return BucketHooks(self.plan, leaves, self._send)

    def micro_batch(self, batch_id: int) -> None:
        """The micro-batch whose backward comes next."""
        self._batch = batch_id

    def drain(self, timeout: float) -> None:
        """Wait until every part is written (raises a writer's error: the step failed)."""
        assert self._outbox is not None
        self._outbox.drain(timeout)

    def settle(self) -> None:
        """After a step, whatever became of it: no part is left being written, since the loop goes on to
        other calls on the same connections, whose only user it must then be. A step that ended with parts
        queued or being written, or a write failed, leaves no sender behind: the connections that carried
        parts are shut (a write blocked on one fails at once), the senders joined, their queues dropped,
        and the connections closed, so the next call opens fresh ones."""
        outbox = self._outbox
        if outbox is None or not outbox.broken:
            return
        links = [link for link, parted in zip(self._links, self.gets_parts, strict=False) if parted]
        for link in links:
            link.interrupt()
        outbox.close()
        self._outbox = None
        for link in links:
            link.close()

    def close(self) -> None:
        """The loop ended: stop the senders (`settle` left none writing)."""
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None

    def _writer(self, shard: int) -> Callable[[Frame], None]:
        def write(frame: Frame) -> None:
            self._links[shard].post(frame)

        return write

    def _send(self, bucket: Bucket, run: torch.Tensor) -> None:
        assert self._outbox is not None
        if run.device.type != "cpu":
            run = run.cpu()  # (a GPU's buckets are copied out on a stream of their own: later)
        generation, step = self._step
        part = Part(generation, step, self._batch, bucket.index, self.bounds[bucket.shard], self._backup)
        self._outbox.put(bucket.shard, part.frame([(Entry("part", self._batch, ""), run)]))


def bucket_push_for(
    overlap: bool | None, plan: Sequence[Sequence[Piece]], params: Mapping[str, torch.Tensor]
) -> BucketPush | None:
    """The loop's `BucketPush` where the job asks for it (`overlap`; None: for a model of
    `OVERLAP_MIN_BYTES` or more) and every shard's parameters are of one dtype (a shard sums its parts
    into one flat run; a model of mixed dtypes pushes whole, as before). `plan`: every shard's pieces;
    `params`: the model's parameters by name (meta tensors)."""
    held = [[p for p in pieces if p.name in params] for pieces in plan]
    size = sum(p.numel * params[p.name].element_size() for pieces in held for p in pieces)
    if overlap is False or (overlap is None and size < OVERLAP_MIN_BYTES):
        return None
    if any(len({params[p.name].dtype for p in pieces}) > 1 for pieces in held):
        return None
    return BucketPush(plan_buckets(plan, params))
