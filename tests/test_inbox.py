"""Frame bodies through shared memory (`inbox.py`) between a loop and a shard on one machine, on real
sockets and real memfds: bitwise the same tensors as through the socket; a slot reused only once nothing
of it is referenced, and the socket when no slot is free; an inbox replaced by a larger one still read for
what was written into the old; an inbox out of reach never used."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from prefect_elastic import inbox
from prefect_elastic.channel import Entry, Frame, ShardLink, decode
from prefect_elastic.inbox import Inbox, Outbox, SharedBodies

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


def test_an_inbox_replaced_by_a_larger_one_still_reads_what_was_written_into_the_old() -> None:
    """A sender may write into the old inbox before it hears of the new one (a loop sends two frames
    before it reads an answer): the header names the inbox, and the receiver reads the right one."""
    receiver, sender = SharedBodies(True), SharedBodies(True)
    try:

        def taught() -> None:
            advert = receiver.outgoing([], 0)
            sender.incoming(advert, 0)

        assert receiver.incoming({}, 1 << 20) is None  # a 1 MB body through the socket: an inbox
        taught()
        small = torch.arange(1 << 18, dtype=torch.float32)  # 1 MB
        fields = sender.outgoing([memoryview(small.numpy()).cast("B")], small.nbytes)
        assert fields["slot"][0] == receiver.inbox.key if receiver.inbox else False
        old_key = fields["slot"][0]
        assert receiver.incoming({}, 3 << 20) is None  # then a larger body by the socket: a new inbox
        assert receiver.inbox is not None and receiver.inbox.key != old_key
        header = {**fields, "tensors": [["grad", 0, "w", "torch.float32", [1 << 18]]]}
        got = decode(header, receiver.incoming(header, small.nbytes))  # type: ignore[arg-type]
        assert torch.equal(got.tensors[0][1], small)
        taught()  # the sender hears of the new inbox, and writes there
        large = torch.arange(3 << 18, dtype=torch.float32)  # 3 MB
        fields = sender.outgoing([memoryview(large.numpy()).cast("B")], large.nbytes)
        assert fields["slot"][0] == receiver.inbox.key
        got = decode(
            {**fields, "tensors": [["grad", 0, "w", "torch.float32", [3 << 18]]]},
            receiver.incoming(dict(fields), large.nbytes),
        )  # type: ignore[arg-type]
        assert torch.equal(got.tensors[0][1], large)
        with pytest.raises(ValueError, match="does not have"):
            receiver.incoming({"slot": [old_key, 0]}, 16)  # the old inbox is let go once the new is used
    finally:
        receiver.close()
        sender.close()


def test_an_inbox_out_of_reach_is_never_used() -> None:
    """Another pid namespace (the descriptor number names another process's file: the token differs),
    another process gone, a body larger than the slots: the socket, as before."""
    box = Inbox(1 << 20)
    other = Inbox(1 << 20)
    try:
        pid, fd, size, token = box.advert()
        assert Outbox.open([pid, fd, size, token]) is not None
        assert Outbox.open([pid, other.fd, size, token]) is None  # someone else's memory
        assert Outbox.open([pid, fd, 2 << 20, token]) is None  # not the size it claims
        assert Outbox.open([2**22 + 7, fd, size, token]) is None  # no such process
        assert Outbox.open(["?"]) is None
        outbox = Outbox.open(box.advert())
        assert outbox is not None
        too_big = memoryview(bytes((1 << 20) + 1))
        assert outbox.place([too_big], too_big.nbytes) is None
        outbox.close()
    finally:
        box.close()
        other.close()


def test_a_loop_over_tcp_never_makes_an_inbox(echo: Served) -> None:
    link = ShardLink(echo.address._replace(local=""), timeout=5)
    try:
        for i in range(3):
            sent = Frame({"op": f"push {i}"}, body(i))
            assert same(sent, link.request(sent))
        assert not link.local and link.shared.inbox is None and link.shared.outbox is None
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
    assert os.getpid()  # (the process survives every close: nothing unmapped under a live view)
