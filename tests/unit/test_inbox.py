"""Frame bodies through shared memory (`wire/inbox.py`) between a loop and a shard on one machine, on real
sockets and real memfds: bitwise the same tensors as through the socket; a slot reused only once nothing
of it is referenced, and the socket when no slot is free; an inbox replaced by a larger one still read for
what was written into the old; an inbox out of reach never used."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prefect_elastic.wire import Entry, Frame, ShardLink, decode, inbox
from prefect_elastic.wire.inbox import Inbox, PeerInbox, SharedBodies

from .test_channel import Served


@pytest.fixture
def echo() -> Iterator[Served]:
    async def handler(frame: Frame) -> Frame:
        return Frame({"echo": frame.header["op"]}, [(e, t.clone()) for e, t in frame.tensors])

    served = Served(handler)
    yield served
    served.close()


def body(i: int) -> list[tuple[Entry, torch.Tensor]]:
    """About 1 MB in tensors of several dtypes, one of them after an odd number of bytes."""
    generator = torch.Generator().manual_seed(i)
    return [
        (Entry("grad", i, "w"), torch.randn(512, 512, generator=generator)),
        (Entry("x", i, ""), torch.randn(3, 5, generator=generator).to(torch.bfloat16)),
        (Entry("state", -1, "mask"), torch.tensor([True, False, True])),
        (Entry("y", i, ""), torch.arange(1000, dtype=torch.int64) * i),
    ]


def same(a: Frame, b: Frame) -> bool:
    return [e for e, _ in a.tensors] == [e for e, _ in b.tensors] and all(
        x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(a.tensors, b.tensors, strict=True)
    )


def test_bodies_go_through_shared_memory_both_ways_and_arrive_bitwise(echo: Served) -> None:
    link = ShardLink(echo.address, timeout=5)
    try:
        for i in range(6):
            sent = Frame({"op": f"push {i}", "generation": 1}, body(i))
            got = link.request(sent)
            assert got.header == {"echo": f"push {i}"}  # (the transport's fields taken out)
            assert same(sent, got)
        assert link.local
        # The first frame each way teaches the other end the inbox; every one after goes through it.
        assert echo.server.bodies == {"socket": 1, "shared": 5}
        assert link.shared.frames == {"socket": 1, "shared": 5}
    finally:
        link.close()


def test_with_every_slot_held_a_body_takes_the_socket_and_a_slot_freed_is_used_again(echo: Served) -> None:
    link = ShardLink(echo.address, timeout=5)
    try:
        link.request(Frame({"op": "first"}, body(0)))
        held = [link.request(Frame({"op": f"held {i}"}, body(i))) for i in range(inbox.SLOTS)]
        assert link.shared.frames["shared"] == inbox.SLOTS
        # Every slot of the loop's inbox holds an answer still referenced: the next comes by the socket.
        sent = Frame({"op": "more"}, body(9))
        assert same(sent, link.request(sent))
        assert link.shared.frames == {"socket": 2, "shared": inbox.SLOTS}
        # What is held was never written over.
        for i, frame in enumerate(held):
            assert same(Frame({}, body(i)), frame)
        # Once the tensors of one are gone, its slot is free again (a view of a tensor keeps it).
        view = held[0].tensors[0][1][3]
        del held[0]
        link.request(Frame({"op": "still held"}, body(1)))
        assert link.shared.frames["socket"] == 3
        del view
        link.request(Frame({"op": "free"}, body(1)))
        assert link.shared.frames == {"socket": 3, "shared": inbox.SLOTS + 1}
    finally:
        link.close()


def test_a_big_models_body_goes_through_an_inbox_of_fewer_slots_and_the_socket_when_both_are_held() -> None:
    """A 26 MB gradient (a shard's half of a 58 MB text model's) comes through shared memory too, in an
    inbox of two slots (`slots_of`: they hold `INBOX_BYTES` together at most); with both held, the next
    takes the socket; one freed is used again. Bodies over `MAX_BYTES` never make an inbox."""
    assert [inbox.slots_of(n << 20) for n in (1, 16, 17, 21, 22, 32, 33, 64)] == [4, 4, 3, 3, 2, 2, 1, 1]
    receiver, sender = pair()
    try:
        gradients = [torch.full((26 << 18,), float(i)) for i in range(3)]  # 26 MiB each
        size = gradients[0].nbytes
        assert receiver.incoming({}, size) is None  # the first by the socket, which makes an inbox
        assert receiver.inbox is not None and receiver.inbox.slots == 2
        sender.incoming(receiver.outgoing([], 0), 0)  # the sender hears of it
        written = [sender.outgoing(flat(g), size) for g in gradients]
        assert [("slot" in w) for w in written] == [True, True, False]  # no third slot
        held = []
        for fields, gradient in zip(written[:2], gradients[:2], strict=True):
            header = {**fields, "tensors": described(gradient)}
            held.append(decode(header, receiver.incoming(header, size)))  # type: ignore[arg-type]
            assert torch.equal(held[-1].tensors[0][1], gradient)
        assert receiver.frames == {"socket": 1, "shared": 2}
        del held[0]  # the shard summed it: its slot is free again
        assert "slot" in sender.outgoing(flat(gradients[2]), size)
        too_big = SharedBodies(os.getpid())
        assert too_big.incoming({}, inbox.MAX_BYTES + 1) is None and too_big.inbox is None
        too_big.close()
    finally:
        receiver.close()
        sender.close()


def pair() -> tuple[SharedBodies, SharedBodies]:
    """Both ends of a connection within this process (the peer's pid is this one's)."""
    return SharedBodies(os.getpid()), SharedBodies(os.getpid())


def flat(t: torch.Tensor) -> list[memoryview]:
    return [memoryview(t.numpy()).cast("B")]


def described(t: torch.Tensor) -> list[list[object]]:
    return [["grad", 0, "w", "torch.float32", list(t.shape)]]


def test_inboxes_replaced_twice_in_flight_are_still_read_for_what_was_written_into_them() -> None:
    """A sender may write into an inbox before it hears of a newer one (a loop sends two frames before
    it reads an answer): the header names the inbox, and the receiver reads that one; an older one is let
    go once the sender writes into a newer."""
    receiver, sender = pair()
    try:

        def taught() -> None:
            sender.incoming(receiver.outgoing([], 0), 0)

        bodies = [torch.arange(n << 18, dtype=torch.float32) for n in (1, 2, 3)]  # 1, 2 and 3 MB
        assert receiver.incoming({}, bodies[0].nbytes) is None  # by the socket: an inbox of 1 MB slots
        taught()
        written = [sender.outgoing(flat(bodies[0]), bodies[0].nbytes)]
        for body in bodies[1:]:  # two larger bodies by the socket, before the sender hears of either inbox
            assert receiver.incoming({}, body.nbytes) is None
        keys = [inbox.key for inbox in receiver._inboxes]
        assert len(keys) == 3 and written[0]["slot"][0] == keys[0]
        taught()  # now of the newest (3 MB slots)
        written += [sender.outgoing(flat(b), b.nbytes) for b in bodies]
        assert [w["slot"][0] for w in written] == [keys[0], keys[2], keys[2], keys[2]]
        for fields, body in zip(written, [bodies[0], *bodies], strict=True):
            header = {**fields, "tensors": described(body)}
            got = decode(header, receiver.incoming(header, body.nbytes))  # type: ignore[arg-type]
            assert torch.equal(got.tensors[0][1], body)
        assert [inbox.key for inbox in receiver._inboxes] == [keys[2]]
        with pytest.raises(ValueError, match="does not have"):
            receiver.incoming({"slot": [keys[0], 0]}, 16)
    finally:
        receiver.close()
        sender.close()


def test_an_advert_is_taken_only_for_the_peers_own_sealed_inbox(tmp_path: Path) -> None:
    """Any process of the machine may connect to a shard's Unix socket and send an advert: it must name
    the peer's pid (as the kernel tells it), a memfd of this module's name, sealed at its size, with its
    token; nothing else is ever opened for writing."""
    box, other = Inbox(1 << 20), Inbox(1 << 20)
    victim = tmp_path / "victim.db"
    victim.write_bytes(bytes(_HEADER_AND_SLOTS))
    try:
        me = os.getpid()
        pid, fd, size, token = box.advert()
        assert PeerInbox.open([pid, fd, size, token], me) is not None
        assert PeerInbox.open([pid, fd, size, token], me + 1) is None  # not the peer's pid
        assert PeerInbox.open([pid, fd, size, token], 0) is None  # a peer in another pid namespace
        assert PeerInbox.open([pid, other.fd, size, token], me) is None  # another inbox: not its token
        assert PeerInbox.open([pid, fd, 2 << 20, token], me) is None  # not the size it claims
        assert PeerInbox.open([pid, fd, size, "00" * 8], me) is None
        assert PeerInbox.open(["?"], me) is None
        with victim.open("r+b") as handle:  # a file this process has open, with the inbox's token in it
            handle.write(bytes.fromhex(token))
            handle.flush()
            assert PeerInbox.open([pid, handle.fileno(), size, token], me) is None
        unsealed = os.memfd_create("prefect-elastic-inbox", os.MFD_CLOEXEC)
        try:
            os.ftruncate(unsealed, len(_HEADER_AND_SLOTS))
            os.pwrite(unsealed, bytes.fromhex(token), 0)
            assert PeerInbox.open([pid, unsealed, size, token], me) is None  # could shrink under the writer
        finally:
            os.close(unsealed)
        assert victim.read_bytes()[16:] == bytes(_HEADER_AND_SLOTS)[16:]
        peer_inbox = PeerInbox.open(box.advert(), me)
        assert peer_inbox is not None
        too_big = memoryview(bytes((1 << 20) + 1))
        assert peer_inbox.place([too_big], too_big.nbytes) is None
        peer_inbox.close()
    finally:
        box.close()
        other.close()


_HEADER_AND_SLOTS = bytes(64 + inbox.SLOTS * (1 << 20))


def test_without_memfd_the_bodies_take_the_socket(echo: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox without memfd_create, the descriptors or the memory used up: the connection goes on."""

    def refused(*args: object) -> int:
        raise PermissionError("memfd_create: operation not permitted")

    monkeypatch.setattr(os, "memfd_create", refused)
    link = ShardLink(echo.address, timeout=5)
    try:
        for i in range(3):
            sent = Frame({"op": f"push {i}"}, body(i))
            assert same(sent, link.request(sent))
        assert link.local and link.shared.frames == {"socket": 3, "shared": 0}
        assert echo.server.bodies == {"socket": 3, "shared": 0}
    finally:
        link.close()


def test_a_loop_over_tcp_never_makes_an_inbox(echo: Served) -> None:
    link = ShardLink(echo.address._replace(local=""), timeout=5)
    try:
        for i in range(3):
            sent = Frame({"op": f"push {i}"}, body(i))
            assert same(sent, link.request(sent))
        assert not link.local and link.shared.inbox is None and link.shared.peer_inbox is None
        assert echo.server.bodies == {"socket": 3, "shared": 0}
    finally:
        link.close()


def test_a_small_body_takes_the_socket(echo: Served) -> None:
    link = ShardLink(echo.address, timeout=5)
    try:
        for i in range(3):
            sent = Frame({"op": f"small {i}"}, [(Entry("grad", i, "b"), torch.full((100,), float(i)))])
            assert same(sent, link.request(sent))
        assert link.shared.inbox is None and echo.server.bodies == {"socket": 3, "shared": 0}
    finally:
        link.close()


def test_a_peer_inbox_closed_twice_or_under_a_copy_neither_raises_nor_unmaps_the_copy() -> None:
    """A loop's connection may be closed by its exchange thread and its main thread at once, while one of
    them copies a body into the peer's inbox."""
    box = Inbox(1 << 20)
    try:
        peer_inbox = PeerInbox.open(box.advert(), os.getpid())
        assert peer_inbox is not None
        copying = peer_inbox._array  # what a copy under way in another thread holds
        assert copying is not None
        peer_inbox.close()
        peer_inbox.close()
        assert not peer_inbox.memory.closed  # still mapped under the copy
        copying[100] = 7
        assert box.memory[100] == 7
        assert peer_inbox.place([memoryview(bytes(10))], 10) is None  # closed: the body takes the socket
        del copying
        bodies = SharedBodies(os.getpid())
        bodies.incoming({"inbox": box.advert()}, 0)
        assert bodies.peer_inbox is not None
        bodies.close()
        bodies.close()
        assert bodies.peer_inbox is None
    finally:
        box.close()
