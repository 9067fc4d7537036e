"""What goes on the wire in one step of a compute loop, as frames (`wire/channel.py`): the answers asked for
ahead of a step (`Ahead`: parameters as flat runs, batches), a micro-batch's gradients for one shard
(`gradient_entries`, packed where that pays: `packs`), the order a step's frames go to the shards in
(`push_order`), and sending and reading a frame per shard (`send_all`, `receive_all`, `exchange`).

Pure of the loop's state: the trainer (`trainer.py`) builds the frames and the loops send them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..data.fields import Batch
from ..errors import FatalError
from ..messages import Tensors
from ..sharding import Piece, split_pieces
from ..wire import Entry, Frame, Next, ShardLink, contiguous_strides
from ..wire.signals import BackupWanted
from .bucket_pull import BucketPull, joined_now

if TYPE_CHECKING:
    import numpy as np

# A micro-batch's gradients for one shard up to this size go as one flat run (`gradient_entries`).
PACK_BYTES = 1 << 20


@dataclass
class Ahead:
    """The answers for one step, asked for before it starts: from every shard, its parameters of that
    step (sent the moment the shard applied the step before) and the batches of the share it holds, or
    the error that came instead (not applied within the wait, a fence)."""

    generation: int
    step: int
    frames: list[Frame]

    def unpack(
        self,
        shapes: dict[str, torch.Size],
        plan: Sequence[Sequence[Piece]] = (),
        pull: BucketPull | None = None,
        wholes: dict[str, tuple[torch.Tensor, np.ndarray]] | None = None,
    ) -> tuple[Tensors, dict[int, Batch]]:
        """The parameters and buffers (views of the frames' tensors), and the batches by batch id.
        `shapes`: every parameter's and buffer's shape, for the shards that send theirs as flat runs;
        `plan`: each shard's pieces, where a tensor split across shards comes in parts (each answer names
        its shard), joined here into a whole tensor that `wholes` keeps for the next step (the loop's: a
        step's parameters are dropped before the next step's are unpacked), or that `pull` keeps. `pull`:
        where an answer's parameters follow in buckets, it gives the flat tensor they will be read into
        (`bucket_pull.py`), still empty here, and joins split tensors as their buckets arrive."""
        state: Tensors = {}
        parts: dict[str, list[tuple[int, Piece, torch.Tensor]]] = {}  # (shard, piece, its run) by name
        batches: dict[int, Batch] = {}
        answers = [Next.of(frame.header) for frame in self.frames]
        failures = [error for answer in answers if (error := answer.failure()) is not None]
        backups = [error for error in failures if isinstance(error, BackupWanted)]
        for error in failures:
            if not isinstance(error, BackupWanted):
                raise error
        if backups:
            # Every shard that asked for a backup, as one: two may lack different batch ids (a straggler's
            # push reached one of them only).
            missing = tuple(sorted({b for e in backups for b in e.batch_ids}))
            raise BackupWanted(backups[0].step, missing)
        for frame, answer in zip(self.frames, answers, strict=True):
            split = split_pieces(plan, answer.shard)
            held = {**shapes, **{n: torch.Size([p.numel]) for n, p in split.items()}} if split else shapes
            found: Tensors = {}
            names = answer.params or []
            if answer.follow:
                if pull is None:
                    raise FatalError("an answer's parameters follow in buckets, which this loop did not ask")
                found.update(unflatten(names, pull.expect(answer), held))
            for entry, tensor in frame.tensors:
                if entry.kind == "state":
                    found[entry.name] = tensor
                elif entry.kind == "params":
                    found.update(unflatten(names, tensor, held))
                elif entry.kind == "buffers":  # (one flat run of the shard's buffers of one dtype)
                    found.update(unflatten((answer.buffers or [])[entry.batch_id], tensor, held))
                elif entry.kind == "field":  # (a field of a batch the shard made: `data_server/partition.py`)
                    batches.setdefault(entry.batch_id, {})[entry.name] = tensor
            for name, tensor in found.items():
                if name in split:
                    assert answer.shard is not None  # (`split` is empty for an answer of no shard)
                    parts.setdefault(name, []).append((answer.shard, split[name], tensor))
                else:
                    state[name] = tensor
        for name, runs in parts.items():
            if pull is not None:
                # (Runs still to come in buckets: the pull joins each into place as it arrives.)
                state[name] = pull.joined(name, shapes[name], runs)
            else:
                state[name] = joined_now({} if wholes is None else wholes, name, shapes[name], runs)
        return state, batches


def moved_as_one(
    names: Sequence[str], tensors: Sequence[torch.Tensor], shapes: dict[str, torch.Size], device: torch.device
) -> Tensors:
    """`tensors` (named `names`, of one dtype) on `device`, as views of one flat tensor: one transfer
    between host and GPU where there would be one per tensor."""
    return unflatten(names, torch.cat([t.detach().reshape(-1) for t in tensors]).to(device), shapes)


def unflatten(names: Sequence[str], flat: torch.Tensor, shapes: dict[str, torch.Size]) -> Tensors:
    """Views of a shard's flat parameters (`names` in their order), one per parameter."""
    views: Tensors = {}
    at = flat.storage_offset()
    try:
        for name in names:
            shape = shapes[name]
            views[name] = flat.as_strided(shape, contiguous_strides(shape), at)
            at += shape.numel()
    except (KeyError, RuntimeError) as exc:  # not a parameter of the model; past the tensor's end
        raise FatalError(f"a shard sent parameters that do not fit the model: {exc}") from None
    expected = at - flat.storage_offset()
    if flat.dim() != 1 or not flat.is_contiguous() or expected != flat.numel():
        raise FatalError(
            f"a shard sent {flat.numel()} parameter elements for {len(names)} tensors of {expected}"
        )
    return views


def packs(params: Sequence[torch.Tensor]) -> bool:
    """Whether a shard with these parameters gets each micro-batch's gradients packed into one flat run
    (`gradient_entries`): more than one tensor, of one dtype, `PACK_BYTES` at most in all.

    Why: a frame costs a few microseconds per tensor to encode and decode, on both sides, and a step
    moves two of them each way; a model of many small tensors (a transformer's 16 of 40 KB in all) paid
    more for that than for its bytes. Packing copies the bytes once, which beyond `PACK_BYTES` costs
    more than it saves."""
    return (
        len(params) > 1
        and len({t.dtype for t in params}) == 1
        and sum(t.numel() * t.element_size() for t in params) <= PACK_BYTES
    )


def gradient_entries(
    batch_id: int, grads: list[tuple[str, torch.Tensor]], packed: bool
) -> list[tuple[Entry, torch.Tensor]]:
    """One micro-batch's gradients for one shard, in the plan's order: one flat run (kind `grads`, which
    the frame's `order` names) where `packed` (`packs`), else one entry each."""
    if packed:
        return [(Entry("grads", batch_id, ""), torch.cat([t.reshape(-1) for _, t in grads]))]
    return [(Entry("grad", batch_id, n), t) for n, t in grads]


def send_all(links: list[ShardLink], frames: Sequence[Frame | None], order: Sequence[int] = ()) -> None:
    """Frame `i` to shard `i`, in `order` where given (every index once), else in index order."""
    for i in order or range(len(links)):
        frame = frames[i]
        if frame is not None:
            links[i].send(frame)


def push_order(held_bytes: Sequence[int]) -> list[int]:
    """The order a step's frames go to the shards in: the shards holding the most parameter bytes first,
    ties in index order.

    Why: a push wakes the shard it reaches, and on a busy machine the woken process may take the sender's
    core before the next frame is written; the shard with the most to receive, apply and answer is the
    one the step waits for, so it should start first, while a shard without parameters (it only counts
    the step's batch ids) takes its turn beside it. Measured on the transformer, whose parameters all lie
    on data server 1 (4 alternating pairs): the push phase 1.97 ms a step against 2.33 ms."""
    return sorted(range(len(held_bytes)), key=lambda i: (-held_bytes[i], i))


def receive_all(links: list[ShardLink], count: list[int], timeout: float) -> list[Frame]:
    """Read `count[i]` answers from shard `i`, every one of them even after an error (no connection is
    left with an answer unread); raises the first error."""
    answers: list[Frame] = []
    first: BaseException | None = None
    for link, n in zip(links, count, strict=True):
        for _ in range(n):
            try:
                answers.append(link.receive(timeout))
            except Exception as exc:
                first = first or exc
                break  # the link closed itself: nothing more to read there
    if first is not None:
        raise first
    return answers


def exchange(links: list[ShardLink], frames: list[Frame], timeout: float) -> list[Frame]:
    """One frame to every shard, then every answer."""
    send_all(links, frames)
    return receive_all(links, [1] * len(links), timeout)
