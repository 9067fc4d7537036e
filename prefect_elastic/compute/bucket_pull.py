"""A sync step's parameters arriving bucket by bucket during forward (`ElasticJob.overlap_pull`).

The push that seals a step asks each shard for the next step's parameters as the buckets of the loop's
plan (`then.buckets`: their ranges of the shard's flat parameters). The shard's answer then carries the
buffers and the batches, and says how many frames follow: one per bucket, in forward order, each made
from the copy published for that step just before it is written (`data_server/frames.py`). The loop
takes the step's parameters as views of a flat buffer of its own per shard, which a thread per shard
reads the buckets into straight off the socket as they come, and a module's forward pre-hook
(`buckets.ForwardGate`) waits until the buckets of its own parameters are in: forward starts while later
layers' parameters still cross. The first forward's end waits for the rest (`rest`), so the links are the
loop's again before backward's sender threads post parts on them.

The buffer is written below torch (the socket, or numpy from the shared inbox), so the version counters
of the parameters' views do not move: autograd's saved tensors stay valid, and the trainer's check that a
model did not change its parameters in place is not misled. The buffer is reused step after step: a
step's parameters are dropped before the next step's answers are read.

A tensor split across shards is the parameter forward sees as a whole tensor of the pull's own (reused too),
and each piece is copied into place from the shard's buffer as the bucket holding it arrives.

A parameter a module reads before its own module runs (a parent reading its child's weight, as
`nn.MultiheadAttention` reads `out_proj.weight`) is waited for in the pre-hook of the module that reads
it, found once on the meta model (`buckets.unguarded`, the trainer's `early_reads`).

Where it is not asked for: a GPU worker (the parameters are copied to the device before forward; the
copies on a stream of their own are later work), and a model whose forward does not run on the meta
device (a data-dependent one): those pull whole, as before. `overlap_pull=None` asks only where
the bytes cross a socket: on the shard's machine a loop reads the parameters in place, with nothing to
overlap.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..data_server.bucket_plan import Bucket
from ..errors import FatalError
from ..sharding import Piece
from ..wire import Ask, Frame, Next, ParamsBucket, ShardLink
from ..wire.codec import _dtype
from .buckets import Key


class BucketPull:
    """The buckets of `plan` (every shard's, `plan_buckets`) that a loop's pulls ask for, and their reading.
    `everywhere`: also from a shard on this machine (`overlap_pull=True`).

    A step's buckets are read by a thread per shard (`start`), so that the bytes keep crossing while
    forward computes: read by the forward's own thread, they would stop at the socket's buffer whenever
    forward ran ahead of them. The thread holds the link until `rest` (or `abort`) joined it: the loop sends
    nothing on it meanwhile (the step's batch requests leave before `start`, backward's parts after)."""

    def __init__(self, plan: Sequence[Sequence[Bucket]], everywhere: bool) -> None:
        self.plan = [list(buckets) for buckets in plan]
        self._bounds = [[[b.start, b.stop] for b in buckets] for buckets in self.plan]
        self._everywhere = everywhere
        self._buffers: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        self._links: Sequence[ShardLink] = ()
        self._owed: set[int] = set()  # the shards whose answers of this step follow in buckets
        # Tensors split across shards, whole, by name (the parameters forward sees), and where each piece
        # read into a shard's buffer goes in them: (shard, the piece's range in its flat, bytes of the
        # whole tensor it fills), for this step.
        self._wholes: dict[str, tuple[torch.Tensor, np.ndarray]] = {}
        self._joins: dict[int, list[tuple[int, int, np.ndarray]]] = {}
        self._readers: ThreadPoolExecutor | None = None
        self._reading: list[Future[None]] = []
        self._arrived = threading.Condition()
        self._read: dict[int, int] = {}  # shard -> its buckets read so far this step (under `_arrived`)
        self._errors: dict[int, BaseException] = {}  # shard -> what its read raised this step
        self.received = 0  # buckets read, over the loop's life
        # What the last failed read raised: it surfaces in a module's forward pre-hook, and the trainer
        # tells it from the model's own errors by identity.
        self.failure: BaseException | None = None

    def ask(self, links: Sequence[ShardLink], asks: list[Ask]) -> list[Ask]:
        """`asks` (one per shard, for the next step), those for parameters asking for them in buckets."""
        return [
            replace(ask, buckets=self._bounds[i])
            if ask is not None
            and ask.step is not None
            and self.plan[i]
            and (self._everywhere or not links[i].local)
            else ask
            for i, ask in enumerate(asks)
        ]

    def expect(self, answer: Next) -> torch.Tensor:
        """An answer whose parameters follow in buckets: the flat tensor they are read into (the step's
        parameters are views of it)."""
        shard, numel, dtype = answer.shard, answer.numel, answer.dtype
        if shard is None or numel is None or dtype is None:
            raise FatalError(f"an answer of buckets that names no shard, size or dtype: {answer}")
        if not 0 <= shard < len(self.plan) or answer.follow != len(self.plan[shard]):
            raise FatalError(f"data server {shard} answered with {answer.follow} buckets, not its plan's")
        self._owed.add(shard)
        return _reused(self._buffers, shard, torch.Size([numel]), _dtype(dtype))[0]

    def joined(
        self, name: str, shape: torch.Size, runs: Sequence[tuple[int, Piece, torch.Tensor]]
    ) -> torch.Tensor:
        """Tensor `name` (of `shape`), split across shards, whole: each of its `runs` (the shard, its piece,
        the run) copied into place, now where its shard answered whole, else as its bucket arrives."""
        whole, places = whole_of(self._wholes, name, shape, runs)
        for shard, run, into in places:
            if shard in self._owed:  # (its bytes are not in yet)
                at = int(run.storage_offset())
                self._joins.setdefault(shard, []).append((at, at + run.numel(), into))
            else:
                np.copyto(into, run.reshape(-1).view(torch.uint8).numpy())
        return whole

    @property
    def owed(self) -> bool:
        """Whether buckets of the step's answers are still to be read (or being read)."""
        return bool(self._owed)

    def start(self, links: Sequence[ShardLink]) -> Sequence[Sequence[Bucket]]:
        """The step begins on `links`: a thread per shard that owes buckets reads them into place, in the
        order it sends them. Returns the buckets still to come (a `ForwardGate`'s plan)."""
        self._links = links
        self._read = {shard: 0 for shard in self._owed}
        self._errors = {}
        self.failure = None
        readers = self._readers
        if readers is None:
            readers = self._readers = ThreadPoolExecutor(len(self.plan), thread_name_prefix="bucket-pull")
        self._reading = [readers.submit(self._read_all, shard) for shard in sorted(self._owed)]
        return [buckets if shard in self._owed else [] for shard, buckets in enumerate(self.plan)]

    def receive(self, wanted: Key) -> Bucket:
        """Bucket `wanted`, once its thread read it into place (raises what that shard answered instead:
        a fence, or the step applied on, between two buckets; or what the read raised)."""
        shard, index = wanted
        if shard not in self._owed or not 0 <= index < len(self.plan[shard]):
            raise FatalError(f"bucket {wanted} asked for, but data server {shard} owes none")
        with self._arrived:
            while self._read[shard] <= index and shard not in self._errors:
                self._arrived.wait()
            if self._read[shard] <= index:
                self.failure = self._errors[shard]
                raise self.failure
        return self.plan[shard][index]

    def rest(self) -> None:
        """Until every bucket still owed is read (the parameters no module's hook waited for); raises the
        first read's error."""
        try:
            for reading in self._reading:
                reading.result()
            if self._errors:
                self.failure = next(iter(self._errors.values()))
                raise self.failure
        finally:
            self._clear()

    def abort(self) -> None:
        """The step failed with buckets unread: the connections of the shards that still owe some are shut
        (a read under way fails at once), the threads joined, and those connections closed (the next call
        opens new ones)."""
        with self._arrived:
            unread = [s for s in self._owed if self._read.get(s, 0) < len(self.plan[s]) or s in self._errors]
        for shard in unread:
            self._links[shard].interrupt()
        wait(self._reading)
        for shard in unread:
            self._links[shard].close()
        self._clear()

    def drop(self) -> None:
        """Forget a step that ended before its buckets were asked to be read (nothing is reading)."""
        if self._reading:
            self.abort()
        self._clear()

    def close(self) -> None:
        """The loop ended: no thread reads any more."""
        if self._reading:
            self.abort()
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None

    def _clear(self) -> None:
        self._owed.clear()
        self._joins.clear()
        self._reading = []

    def _read_all(self, shard: int) -> None:
        link = self._links[shard]  # (the loop may put a new link in its place once this one failed)
        flat, raw = self._buffers[shard]
        size = flat.element_size()
        joins = self._joins.get(shard, [])
        for bucket in self.plan[shard]:
            into = raw[bucket.start * size : bucket.stop * size]
            try:
                frame = link.receive(into=into)
                self._place(frame, bucket, into)
            except BaseException as exc:
                with self._arrived:
                    self._errors[shard] = exc
                    self._arrived.notify_all()
                return
            for start, stop, whole in joins:
                # (The part of a split tensor's piece that this bucket holds, into the whole tensor.)
                lo, hi = max(start, bucket.start), min(stop, bucket.stop)
                if lo < hi:
                    whole[(lo - start) * size : (hi - start) * size] = raw[lo * size : hi * size]
            with self._arrived:
                self._read[shard] += 1
                self.received += 1
                self._arrived.notify_all()

    @staticmethod
    def _place(frame: Frame, bucket: Bucket, into: np.ndarray) -> None:
        if ParamsBucket.of(frame.header).bucket != bucket.index or len(frame.tensors) != 1:
            raise FatalError(f"bucket {bucket.index} of data server {bucket.shard} expected: {frame.header}")
        run = frame.tensors[0][1]
        if run.numel() != bucket.numel or run.dtype != bucket.dtype:
            raise FatalError(f"bucket {bucket.index} of data server {bucket.shard} does not fit its range")
        if run.data_ptr() != into.ctypes.data:
            # Read in place in the shard's published memory (the same machine): copied below torch.
            np.copyto(into, run.view(torch.uint8).numpy())


def _reused(
    held: dict[Any, tuple[torch.Tensor, np.ndarray]], key: Any, shape: torch.Size, dtype: torch.dtype
) -> tuple[torch.Tensor, np.ndarray]:
    """The tensor `held` keeps under `key`, with its bytes as numpy (written below torch: no version
    counter moves), made anew only where its shape or dtype changed: a step's buffers are the next's."""
    kept = held.get(key)
    if kept is None or kept[0].shape != shape or kept[0].dtype != dtype:
        tensor = torch.empty(shape, dtype=dtype)
        kept = held[key] = (tensor, tensor.view(-1).view(torch.uint8).numpy())
    return kept


def whole_of(
    held: dict[Any, tuple[torch.Tensor, np.ndarray]],
    name: str,
    shape: torch.Size,
    runs: Sequence[tuple[int, Piece, torch.Tensor]],
) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor, np.ndarray]]]:
    """Tensor `name` (of `shape`), split across shards, as the whole tensor `held` keeps for it, and where
    each of its `runs` (the shard, its piece, the run) goes in it: (the shard, the run, those bytes)."""
    whole, raw = _reused(held, name, shape, runs[0][2].dtype)
    if sum(piece.numel for _, piece, _ in runs) != whole.numel():
        raise FatalError(f"the pieces of {name} from the data servers do not cover it")
    size = whole.element_size()
    return whole, [(shard, run, raw[piece.start * size : piece.stop * size]) for shard, piece, run in runs]


def joined_now(
    held: dict[Any, tuple[torch.Tensor, np.ndarray]],
    name: str,
    shape: torch.Size,
    runs: Sequence[tuple[int, Piece, torch.Tensor]],
) -> torch.Tensor:
    """Tensor `name`, split across shards, whole, in the tensor `held` keeps for it step after step: a new
    one each step would be mapped afresh (glibc maps a block over `allocator.MMAP_THRESHOLD` on its own),
    and the page faults of the mlp-50's 41 MB layer cost 15 ms a step over the copy's 4."""
    whole, places = whole_of(held, name, shape, runs)
    for _, run, into in places:
        np.copyto(into, run.reshape(-1).view(torch.uint8).numpy())
    return whole


def bucket_pull_for(
    overlap: bool | None, plan: Sequence[Sequence[Bucket]] | None, device: torch.device
) -> BucketPull | None:
    """The loop's `BucketPull` where the job allows it (`overlap`; None: where the bytes cross a socket),
    the step has a bucket plan (`overlap_push`'s), and the worker computes on the CPU."""
    if overlap is False or plan is None or device.type != "cpu" or not any(plan):
        return None
    return BucketPull(plan, everywhere=overlap is True)
