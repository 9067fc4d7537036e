"""Frame bodies through shared memory, between a compute loop and a shard on one machine.

Why: on the local path (a Unix socket, `ChannelAddress.local`) a frame's tensor bytes are still copied into
the kernel by the sender and out of it by the receiver, with a system call per chunk. The mlp's step moves
2.7 MB each way, and those four copies were most of its fixed cost (docs/benchmarks.md, "Issue 9"). Here
the sender copies a body once, into a slot of memory the receiver shares, and sends only the header through
the socket; the receiver's tensors are views of the slot (no copy at all on its side). Measured in two
processes here, a 2.7 MB round trip: 1.6 to 1.9 ms through the socket, 1.0 to 1.1 ms this way.

How, per connection and per direction:
- The receiver makes an `Inbox` (a memfd of a few slots, each the size of the largest body it has read
  from the socket so far) once a body between `MIN_BYTES` and `MAX_BYTES` came through the socket, and
  names it in the header of its next frame to the peer (`advert`: its pid, the descriptor, the slots'
  size, a random token).
- The sender maps it (`PeerInbox.open`, through `/proc/<pid>/fd/<fd>`, only if that is the peer's own
  sealed inbox: see there), and from then on writes every body
  that fits into a free slot, marks the slot taken, and names the slot in the header (`slot`).
- The receiver's tensors of that frame are views of the slot. When the last of them is gone (`weakref` on
  the array they all keep alive), the slot is marked free again.

Nothing depends on it working (and `PREFECT_ELASTIC_SHARED_MEMORY=0` in the workers' environment turns it
off): a peer in another pid namespace (the kernel gives its pid as 0), a sender that cannot map the inbox
(another user: permission denied), no memfd (a sandbox), a body too large, or no free slot (the receiver
still holds every slot's tensors), and the body goes through the socket as before. The header that names
a slot is sent after the body is written (the system call orders the two), and a slot is reused only after
the receiver marked it free, once nothing of it is referenced any more.

Bounded memory: an inbox's slots hold `INBOX_BYTES` together at most (`slots_of`: `SLOTS` slots of up
to 16 MiB, fewer of larger ones: two of 32 MiB, one of 64), only on connections that carry bodies of that
size, and the kernel gives a slot pages only once it is written. Larger bodies go through the socket, as
do one-off frames (a replica taken from a peer: its link never reads a second answer, so never advertises
an inbox). Why bodies of tens of MB come this way too: a big model's whole push to a shard (26 MB, half of
a 58 MB text model's gradient) through the socket is copied into the kernel and out of it again, into a
buffer made for the frame, after backward and before the shard can start its update; through the inbox
the loop's push phase of that model went from 35-38 ms a step to 20 (docs/benchmarks.md, "Big bodies
through shared memory").
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import memfd, published

ENV = memfd.ENV  # set to 0 to send every body through the socket
# Bodies smaller than this gain next to nothing from shared memory (a few microseconds of copies).
MIN_BYTES = 64 << 10
# Bodies larger than this go through the socket.
MAX_BYTES = 64 << 20
# Slots of an inbox of small bodies: a loop holds up to four answers of one shard at once (the parameters
# and batches of the step it computes, the next step's early batches, the answer to its push, before its
# caller lets go of the step it passed in). Bodies that large are a big model's gradients, which a shard
# lets go of once summed: fewer slots, so that an inbox holds `INBOX_BYTES` at most.
SLOTS = 4
INBOX_BYTES = 64 << 20
_TOKEN = memfd.TOKEN_BYTES  # the random token at the start of an inbox
_HEADER = 64  # token, then one byte per slot (1: holds a body the receiver has not let go of)
assert _TOKEN + SLOTS <= _HEADER
_ROUND = 1 << 20  # slot sizes are rounded up to this
_UNLOCKED_COPY = 64 << 10  # parts at least this large are copied by numpy, without the GIL
_NAME = "prefect-elastic-inbox"  # the memfd's name (/proc/<pid>/fd/<fd> reads "/memfd:<name> (deleted)")


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a Unix socket (0 when it lives in another pid
    namespace, or the kernel cannot tell)."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, AttributeError):
        return 0
    return int(pid)


def _slot_size(body: int) -> int:
    return -(-body // _ROUND) * _ROUND


def slots_of(slot_bytes: int) -> int:
    """How many slots an inbox of slots of `slot_bytes` has: `SLOTS`, fewer where they would hold more than
    `INBOX_BYTES` together, one at least. Both ends compute it from the advert's slot size."""
    return max(1, min(SLOTS, INBOX_BYTES // max(1, slot_bytes)))


def _free(memory: mmap.mmap, flag: int) -> None:
    if not memory.closed:
        memory[flag] = 0


class Inbox:
    """The receiver's shared memory: `slots_of(slot_bytes)` slots of `slot_bytes` each."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots_of(slot_bytes)
        # Sealed at its size: a peer that opens it can neither shrink it (which would kill this process
        # with SIGBUS at its next read) nor grow it.
        self.fd, self.memory, self.token = memfd.create(_NAME, _HEADER + self.slots * slot_bytes)

    @property
    def key(self) -> str:
        """What a header names this inbox by (an inbox replaced by a larger one may still get a body the
        sender wrote before it heard of the new one)."""
        return self.token.hex()[:16]

    def advert(self) -> list[Any]:
        return [os.getpid(), self.fd, self.slot_bytes, self.token.hex()]

    def body(self, slot: int, size: int) -> np.ndarray:
        """The body a sender wrote into `slot`, as an array that every tensor decoded from it keeps alive;
        the slot is free again once the array is gone."""
        if not 0 <= slot < self.slots or size > self.slot_bytes:
            raise ValueError(f"no slot {slot} of {self.slot_bytes} bytes holds a body of {size} bytes")
        body = np.frombuffer(self.memory, dtype=np.uint8, count=size, offset=_HEADER + slot * self.slot_bytes)
        weakref.finalize(body, _free, self.memory, _TOKEN + slot)
        return body

    def close(self) -> None:
        """Closes the descriptor (once); the memory stays mapped while tensors of it live."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class PeerInbox:
    """The sender's mapping of its peer's inbox."""

    def __init__(self, memory: mmap.mmap, slot_bytes: int, key: str) -> None:
        self.memory = memory
        self.slot_bytes = slot_bytes
        self.slots = slots_of(slot_bytes)
        self.key = key
        self._view = memoryview(memory)
        self._array: np.ndarray | None = np.frombuffer(self._view, dtype=np.uint8)

    @classmethod
    def open(cls, advert: Sequence[Any], peer: int) -> PeerInbox | None:
        """The inbox an `advert` names, mapped; None where this process cannot reach it, or where it is not
        an inbox of `peer` (the pid at the other end of the socket, as the kernel tells it).

        Why so strict: any process of the machine may connect to a shard's Unix socket and send an
        advert. Only the peer's own inbox is ever written into: the advert must name the peer's pid, a
        descriptor of it that is a memfd by this module's name, sealed at its size, with the token
        (`memfd.open_peers`)."""
        try:
            pid, fd, slot_bytes, token = int(advert[0]), int(advert[1]), int(advert[2]), str(advert[3])
            expected = bytes.fromhex(token)
        except (ValueError, TypeError, IndexError):
            return None
        memory = memfd.open_peers(pid, fd, _NAME, _HEADER + slots_of(slot_bytes) * slot_bytes, expected, peer)
        if memory is None:
            return None
        return cls(memory, slot_bytes, token[:16])

    def place(self, parts: Sequence[memoryview], size: int) -> int | None:
        """Copies `parts` (`size` bytes in all) into a free slot, which it marks taken; the slot, or None
        where the body does not fit, no slot is free, or the mapping was closed (from another thread)."""
        # (The local name keeps the mapping alive while this copies: `close` in another thread cannot
        # unmap it under the copy.)
        array = self._array
        if array is None or size > self.slot_bytes:
            return None
        for slot in range(self.slots):
            if array[_TOKEN + slot] == 0:
                array[_TOKEN + slot] = 1
                at = _HEADER + slot * self.slot_bytes
                with array.data as raw:
                    for part in parts:
                        if part.nbytes >= _UNLOCKED_COPY:
                            # numpy copies without the GIL (a memoryview's assignment holds it): a loop's
                            # exchange thread copies a gradient while its compute thread runs.
                            array[at : at + part.nbytes] = np.frombuffer(part, dtype=np.uint8)
                        else:
                            raw[at : at + part.nbytes] = part
                        at += part.nbytes
                return slot
        return None

    def close(self) -> None:
        """Unmaps it; any number of times, from any thread. A copy under way in another thread (a
        connection torn down from another thread) keeps the mapping until it ends: the garbage collector
        unmaps it then."""
        self._array = None
        with contextlib.suppress(BufferError):
            self._view.release()
            self.memory.close()


class SharedBodies:
    """One end of a connection: its inboxes (bodies the peer writes for it), the peer's inbox it writes
    into (`peer_inbox`, a `PeerInbox`), and the peer's published memory it maps (`published.py`; `maps`: a
    loop's end). `peer`: the pid at the other end of a Unix socket (`peer_pid`); 0 turns it all off (TCP,
    a peer in another pid namespace)."""

    def __init__(self, peer: int = 0, counts: dict[str, int] | None = None, maps: bool = True) -> None:
        self.peer = peer
        self.enabled = peer > 0 and memfd.enabled()
        # This end's inboxes, the newest last. An older one stays until the peer writes into a newer
        # one: it may have written into the old before it heard of the new.
        self._inboxes: list[Inbox] = []
        self.peer_inbox: PeerInbox | None = None
        self._advertise = False
        # Bodies received, by the way they came (a server's connections share one count), and
        # `referenced`: tensors sent as a reference to published memory, once there was one.
        self.frames = counts if counts is not None else {"shared": 0, "socket": 0}
        # Published regions (`published.py`). As the sender: the keys of those the peer maps (it said
        # so), and the advert of one to offer in the next header. As the receiver: the regions mapped,
        # by key (the newest two: after a promotion, views of the old may still arrive), the keys that
        # could not be, and the key to confirm in the next header.
        self._maps = self.enabled and maps  # (`maps=False`: a shard's end, which reads no peer's memory)
        self._peer_reads: set[str] = set()
        self._offer: list[Any] | None = None
        self._mapped: dict[str, torch.Tensor] = {}
        self._unmappable: set[str] = set()
        self._confirm: str | None = None

    @property
    def inbox(self) -> Inbox | None:
        """The newest inbox: the one the peer is told of."""
        return self._inboxes[-1] if self._inboxes else None

    def outgoing(self, parts: Sequence[memoryview], size: int) -> dict[str, Any]:
        """Header fields for a frame whose body is `parts`: the slot it was written into (then the body is
        not to be sent), and this end's inbox where the peer has not heard of it yet."""
        fields: dict[str, Any] = {}
        if self._offer is not None:
            fields["published"], self._offer = self._offer, None
        if self._confirm is not None:
            fields["reads"], self._confirm = self._confirm, None
        if self._advertise and self.inbox is not None:
            fields["inbox"] = self.inbox.advert()
            self._advertise = False
        if self.peer_inbox is not None and size >= MIN_BYTES:
            slot = self.peer_inbox.place(parts, size)
            if slot is not None:
                fields["slot"] = [self.peer_inbox.key, slot]
        return fields

    def incoming(self, header: dict[str, Any], size: int) -> np.ndarray | None:
        """The body of a frame with this `header` (taking the transport's fields out of it) when it is in
        the inbox; None when it comes through the socket."""
        self._published(header)
        advert = header.pop("inbox", None)
        if advert is not None and self.enabled:
            old, self.peer_inbox = self.peer_inbox, PeerInbox.open(advert, self.peer)
            if old is not None:
                old.close()
        slot = header.pop("slot", None)
        if slot is None:
            if size:
                self.frames["socket"] += 1
                self._maybe_open(size)
            return None
        key, index = slot
        named = [i for i, inbox in enumerate(self._inboxes) if inbox.key == key]
        if not named:
            raise ValueError(f"a frame names a slot of shared memory this end does not have ({key})")
        for older in self._inboxes[: named[0]]:  # the peer writes into a newer one now
            older.close()
        del self._inboxes[: named[0]]
        self.frames["shared"] += 1
        return self._inboxes[0].body(int(index), size)

    def reference(self, t: torch.Tensor) -> list[Any] | None:
        """Where `t` lies in a published region the peer maps (`[key, offset]`), to be sent instead of its
        bytes; None otherwise, and then a region the peer has not confirmed is offered in the next
        header."""
        if not self.enabled:
            return None
        found = published.region_of(t)
        if found is None:
            return None
        region, at = found
        if region.key in self._peer_reads:
            self.frames["referenced"] = self.frames.get("referenced", 0) + 1
            return [region.key, at]
        self._offer = region.advert()
        return None

    def region(self, key: str) -> torch.Tensor:
        """The bytes of the peer's published region `key`, mapped here (a frame's entry refers to it)."""
        data = self._mapped.get(key)
        if data is None:
            raise ValueError(f"a frame refers to published memory this end has not mapped ({key})")
        return data

    def _published(self, header: dict[str, Any]) -> None:
        reads = header.pop("reads", None)
        if reads is not None:
            self._peer_reads.add(str(reads))
        advert = header.pop("published", None)
        if advert is None or not self._maps:
            return
        key = str(advert[3])[:16] if isinstance(advert, list) and len(advert) == 4 else ""
        if key in self._mapped:
            # Offered again: the peer has not heard this end's word yet (a frame sent before it was
            # given, from the loop's other thread), so it is given again.
            self._confirm = key
            return
        if key in self._unmappable:
            return
        mapped = published.map_peers(advert, self.peer)
        if mapped is None:
            self._unmappable.add(key)
            return
        self._mapped[mapped[0]] = mapped[1]
        while len(self._mapped) > 2:  # (the oldest's views, where a loop holds some, keep it mapped)
            del self._mapped[next(iter(self._mapped))]
        self._confirm = mapped[0]

    def _maybe_open(self, size: int) -> None:
        if not self.enabled or not MIN_BYTES <= size <= MAX_BYTES:
            return
        if self.inbox is not None and size <= self.inbox.slot_bytes:
            return  # (it fits: the sender had no free slot, or has not mapped the inbox yet)
        try:
            inbox = Inbox(min(MAX_BYTES, _slot_size(size)))
        except OSError:  # (no memfd here: a sandbox, the descriptors or the memory used up) the socket
            self.enabled = False
            return
        self._inboxes.append(inbox)
        self._advertise = True

    def close(self) -> None:
        """Lets go of the inboxes and the peer's inbox; any number of times, from any thread (a loop's
        connection may be closed by its exchange thread and its main thread at once)."""
        self._mapped = {}
        inboxes, self._inboxes = self._inboxes, []
        peer_inbox, self.peer_inbox = self.peer_inbox, None
        for inbox in inboxes:
            inbox.close()
        if peer_inbox is not None:
            peer_inbox.close()
