"""A sync step's parameters arriving bucket by bucket during forward (`ElasticJob.overlap_pull`).

The push that seals a step asks each shard for the next step's parameters as the buckets of the loop's
plan (`then.buckets`: their ranges of the shard's flat parameters). The shard's answer then carries the
buffers and the batches, and says how many frames follow: one per bucket, in forward order, each made
from the copy published for that step just before it is written (`data_server/frames.py`). The loop
takes the step's parameters as views of a flat buffer of its own per shard, which the buckets are read
into straight off the socket, and a module's forward pre-hook (`buckets.ForwardGate`) reads until the
buckets of its own parameters are in: forward starts while later layers' parameters still cross.

The buffer is written below torch (the socket, or numpy from the shared inbox), so the version counters
of the parameters' views do not move: autograd's saved tensors stay valid, and the trainer's check that a
model did not change its parameters in place is not misled. The buffer is reused step after step: a
step's parameters are dropped before the next step's answers are read.

Where it is not asked for: a shard holding a piece of a tensor split across shards (the parts are joined
into a new tensor before forward), a GPU worker (the parameters are copied to the device before forward;
the copies on a stream of their own are later work), and a model that reads a parameter outside its own
module's forward (`buckets.unguarded`): those pull whole, as before. `overlap_pull=None` asks only where
the bytes cross a socket: on the shard's machine a loop reads the parameters in place, with nothing to
overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..data_server.bucket_plan import Bucket
from ..errors import FatalError
from ..wire import Frame, ShardLink
from ..wire.codec import _dtype
from .buckets import Key

Ask = dict[str, Any] | None


class BucketPull:
    """The buckets of `plan` (every shard's, `plan_buckets`) that a loop's pulls ask for, and their reading.
    `pulled[i]`: whether shard `i`'s parameters may come in buckets; `everywhere`: also from a shard on
    this machine (`overlap_pull=True`)."""

    def __init__(self, plan: Sequence[Sequence[Bucket]], pulled: Sequence[bool], everywhere: bool) -> None:
        self.plan = [list(buckets) if ok else [] for buckets, ok in zip(plan, pulled, strict=True)]
        self._bounds = [[[b.start, b.stop] for b in buckets] for buckets in self.plan]
        self._everywhere = everywhere
        self._buffers: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        self._links: Sequence[ShardLink] = ()
        self._next: dict[int, int] = {}  # shard -> the index of its next bucket to read
        self.received = 0  # buckets read, over the loop's life
        # What the last failed read raised: it surfaces in a module's forward pre-hook, and the trainer
        # tells it from the model's own errors by identity.
        self.failure: BaseException | None = None

    def ask(self, links: Sequence[ShardLink], asks: list[Ask]) -> list[Ask]:
        """`asks` (one per shard, for the next step), those for parameters asking for them in buckets."""
        for i, ask in enumerate(asks):
            wanted = ask is not None and ask.get("step") is not None and bool(self.plan[i])
            if ask is not None and wanted and (self._everywhere or not links[i].local):
                ask["buckets"] = self._bounds[i]
        return asks

    def expect(self, header: dict[str, Any]) -> torch.Tensor:
        """An answer whose parameters follow in buckets: the flat tensor they are read into (the step's
        parameters are views of it)."""
        shard, numel, dtype = int(header["shard"]), int(header["numel"]), _dtype(header["dtype"])
        if not 0 <= shard < len(self.plan) or int(header["follow"]) != len(self.plan[shard]):
            raise FatalError(f"data server {shard} answered with {header['follow']} buckets, not its plan's")
        held = self._buffers.get(shard)
        if held is None or held[0].numel() != numel or held[0].dtype != dtype:
            flat = torch.empty(numel, dtype=dtype)
            held = self._buffers[shard] = (flat, flat.view(torch.uint8).numpy())
        self._next[shard] = 0
        return held[0]

    @property
    def owed(self) -> bool:
        """Whether buckets of the step's answers are still to be read."""
        return any(n < len(self.plan[shard]) for shard, n in self._next.items())

    def start(self, links: Sequence[ShardLink]) -> Sequence[Sequence[Bucket]]:
        """The step begins on `links`; returns the buckets it still reads (a `ForwardGate`'s plan)."""
        self._links = links
        return [buckets if shard in self._next else [] for shard, buckets in enumerate(self.plan)]

    def receive(self, wanted: Key) -> Bucket:
        """The next bucket from the shard of `wanted`, read into its place (raises what the shard
        answered instead: a fence, or the step applied on, between two buckets)."""
        shard = wanted[0]
        index = self._next.get(shard, len(self.plan[shard]))
        if index >= len(self.plan[shard]):
            raise FatalError(f"bucket {wanted} asked for, but data server {shard} owes none")
        bucket = self.plan[shard][index]
        flat, raw = self._buffers[shard]
        size = flat.element_size()
        into = raw[bucket.start * size : bucket.stop * size]
        try:
            frame = self._links[shard].receive(into=into)
            self._place(frame, bucket, into)
        except BaseException as exc:
            self.failure = exc
            raise
        self._next[shard] = index + 1
        self.received += 1
        return bucket

    def rest(self) -> None:
        """Read every bucket still owed (the parameters no module's hook waited for)."""
        for shard, n in list(self._next.items()):
            for index in range(n, len(self.plan[shard])):
                self.receive((shard, index))
        self._next.clear()

    def drop(self) -> None:
        """The step ended without reading them all (the links that owe buckets are closed by the loop)."""
        self._next.clear()

    @staticmethod
    def _place(frame: Frame, bucket: Bucket, into: np.ndarray) -> None:
        if frame.header.get("bucket") != bucket.index or len(frame.tensors) != 1:
            raise FatalError(f"bucket {bucket.index} of data server {bucket.shard} expected: {frame.header}")
        run = frame.tensors[0][1]
        if run.numel() != bucket.numel or run.dtype != bucket.dtype:
            raise FatalError(f"bucket {bucket.index} of data server {bucket.shard} does not fit its range")
        if run.data_ptr() != into.ctypes.data:
            # Read in place in the shard's published memory (the same machine): copied below torch.
            np.copyto(into, run.view(torch.uint8).numpy())


def bucket_pull_for(
    overlap: bool | None,
    plan: Sequence[Sequence[Bucket]] | None,
    split: Sequence[bool],
    device: torch.device,
) -> BucketPull | None:
    """The loop's `BucketPull` where the job allows it (`overlap`; None: where the bytes cross a socket),
    the step has a bucket plan (`overlap_push`'s), the worker computes on the CPU, and for the shards
    that hold no piece of a split tensor (`split[i]`)."""
    if overlap is False or plan is None or device.type != "cpu":
        return None
    pulled = [bool(buckets) and not s for buckets, s in zip(plan, split, strict=True)]
    return BucketPull(plan, pulled, everywhere=overlap is True) if any(pulled) else None
