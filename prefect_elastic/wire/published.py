"""A shard's parameters read in place by the compute loops on its machine (sync mode), instead of copied
into each loop's inbox every step.

Why: a sync shard answers every pull with its parameters. Through an inbox (`inbox.py`) that is one copy
per step of the whole flat tensor; for the mlp, 2.7 MB and 0.6 ms of a fixed cost of about 3 ms
(docs/benchmarks.md, "Issue 9"). Here the shard keeps its flat parameters (`ShardOptimizer.flat`) in a
sealed memfd from the start (`flat_tensor`), and a loop on its machine maps that memfd once and takes the
parameters as views of it: the answer carries where they lie, not their bytes.

Why the loop may read memory the shard writes (docs/design/step-channel.md, "On the same machine, the
parameters read in place"): in sync mode a shard writes its parameters
- when it applies step `s`: only once it holds every gradient of `s`. Every loop that computes with
  the parameters of `s` does so for a share that is not empty, and pushes its gradients of that share
  after its last backward. So no loop reads them any more. (A loop that fetches a step again, after a
  push that went in at one shard and failed at another, asks for a copy: `MicroBatchTrainer.fetch`.);
- when it restores a snapshot (a rollback): that starts a new generation, and a loop of the old one that
  still reads them computes gradients the shard refuses (their generation is stale);
- when the overlapped step (`overlap_push`) applies a bucket into the shard's other copy
  (`data_server/other_copy.py`): that copy holds the version before the published one, which no loop of
  the generation reads any more (each sealed its share of that step before it committed); the commit
  then publishes it, and the copy published until then becomes the one written next;
- never else: a promotion or a restart builds a new optimizer, whose parameters lie elsewhere; the old
  memfd stays mapped, unchanged, for as long as a loop holds views of it.
Only entries of kind `params` go this way (`codec.BY_REFERENCE`): the sync pull's answer. Async mode
answers with entries of kind `state` (a copy, or the live tensors serialized before any apply can run),
since there a shard applies while loops compute.

How, per connection:
- the shard names the memfd in the header of an answer that carries the parameters (`published`: its pid,
  the descriptor, the size, a random token), and still sends their bytes;
- the loop maps it (`memfd.open_peers`: only the peer's own sealed memfd by this name, with the token) and
  says so in the header of its next frame (`reads`: the key);
- from then on the shard describes the entry by `[key, offset]`, and sends no bytes for it.
A loop that cannot map it (another user, no memfd, `PREFECT_ELASTIC_SHARED_MEMORY=0`) never says so, and
keeps getting the bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import memfd

_NAME = "prefect-elastic-params"  # the memfd's name (/proc/<pid>/fd/<fd> reads "/memfd:<name> (deleted)")
# The tensor starts a page into the memfd (the token before it): aligned as any large allocation is.
_DATA = mmap.PAGESIZE
# The published regions of this process alive now (a sender finds the one a tensor lies in). Under the
# lock: a data server is made in a task's thread while another's event loop looks a tensor up.
_LIVE: weakref.WeakSet[Published] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


class Published:
    """A sealed memfd whose bytes (`data`, from `_DATA` on) local peers may map and read in place."""

    def __init__(self, nbytes: int) -> None:
        self.size = _DATA + nbytes
        self.fd, memory, self.token = memfd.create(_NAME, self.size)
        self.key = self.token.hex()[:16]
        # The tensors made of it keep the mapping alive (numpy's export of it); this object keeps the
        # descriptor, which a peer opens through /proc, open.
        self.data = torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=nbytes, offset=_DATA))
        self.start = self.data.data_ptr()
        self.end = self.start + nbytes
        weakref.finalize(self, os.close, self.fd)
        with _LIVE_LOCK:
            _LIVE.add(self)

    def advert(self) -> list[Any]:
        return [os.getpid(), self.fd, self.size, self.token.hex()]

    def place_of(self, t: torch.Tensor) -> int | None:
        """The byte offset of contiguous `t` in this region, or None where it does not lie within it."""
        at = t.data_ptr()
        if self.start <= at and at + t.numel() * t.element_size() <= self.end:
            return at - self.start
        return None


def flat_tensor(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, Published | None]:
    """`parts` copied into one flat tensor of `dtype`, and the published region it lies in where memfds can
    be made (else None: plain memory, copied into every answer). Small ones too: the region costs a page
    more, and every shard then takes one path, the one the tests exercise. The caller
    keeps the region as long as it keeps the tensor: the region holds the descriptor a peer opens."""
    flat, region = empty_flat(sum(p.numel() for p in parts), dtype)
    torch.cat([p.detach().reshape(-1) for p in parts], out=flat)
    return flat, region


def empty_flat(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Published | None]:
    """A flat tensor of `numel` elements of `dtype`, not written yet, in a published region where memfds
    can be made (else plain memory, and None): as `flat_tensor`, for a copy whose values come later."""
    region: Published | None = None
    if memfd.enabled():
        with contextlib.suppress(OSError):
            region = Published(numel * dtype.itemsize)
    flat = region.data.view(dtype) if region is not None else torch.empty(numel, dtype=dtype)
    return flat, region


def region_of(t: torch.Tensor) -> tuple[Published, int] | None:
    """The live published region `t` lies in and its byte offset there, or None."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for region in live:
        at = region.place_of(t)
        if at is not None:
            return region, at
    return None


def map_peers(advert: Sequence[Any], peer: int) -> tuple[str, torch.Tensor] | None:
    """The region an advert names, mapped, as its key and its bytes (uint8); None where it is not `peer`'s
    own published region (`memfd.open_peers`) or cannot be mapped here."""
    try:
        pid, fd, size, token = int(advert[0]), int(advert[1]), int(advert[2]), str(advert[3])
        expected = bytes.fromhex(token)
    except (ValueError, TypeError, IndexError):
        return None
    if size <= _DATA:
        return None
    memory = memfd.open_peers(pid, fd, _NAME, size, expected, peer)
    if memory is None:
        return None
    data = torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=size - _DATA, offset=_DATA))
    return token[:16], data
