"""The step path's wire (`wire/channel.py`) on real sockets, without a cluster: frames keep every tensor
bitwise, answers come back in order when a loop sends two frames before reading, a shard's errors come
back as the same error types, and a connection that failed is never read again."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from prefect_elastic.errors import FatalError
from prefect_elastic.wire import Entry, Frame, ShardLink, ShardServer, decode, encode
from prefect_elastic.wire.signals import RecoverableError, StaleGenerationError


class Served:
    """A ShardServer on an event loop in a thread, as on a static worker."""

    def __init__(self, handler: object) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ShardServer(handler)  # type: ignore[arg-type]
        self.address = asyncio.run_coroutine_threadsafe(self.server.start("127.0.0.1"), self.loop).result(5)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.aclose(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def echo() -> Iterator[Served]:
    async def handler(frame: Frame) -> Frame:
        op = frame.header["op"]
        if op == "stale":
            raise StaleGenerationError(1, 2, "push")
        if op == "wait":
            raise RecoverableError("not applied yet")
        if op == "fatal":
            raise FatalError("batch 7 lives on data server 1")
        if op == "bug":
            raise KeyError("oops")
        if op == "slow":
            await asyncio.sleep(float(frame.header["seconds"]))
        return Frame({"ok": True, "echo": frame.header}, frame.tensors)

    served = Served(handler)
    yield served
    served.close()


def tensors() -> list[tuple[Entry, torch.Tensor]]:
    return [
        (Entry("grad", 3, "conv.weight"), torch.randn(4, 3, 3, 3)),
        (Entry("buffer", 3, "bn.num_batches_tracked"), torch.tensor(5)),
        (Entry("x", 9, ""), torch.randn(2, 1, 4, 4).to(torch.bfloat16)),
        (Entry("y", 9, ""), torch.tensor([1, 0], dtype=torch.int64)),
        (Entry("state", -1, "mask"), torch.tensor([True, False, True])),
        (Entry("state", -1, "empty"), torch.empty(0, 5)),
        (Entry("state", -1, "strided"), torch.arange(12.0).reshape(3, 4).t()),  # not contiguous
    ]


def test_a_frame_keeps_every_tensor_bitwise_without_pickle() -> None:
    sent = Frame({"op": "push", "generation": 4, "losses": {"3": 0.25}}, tensors())
    parts = encode(sent)
    wire = b"".join(bytes(p) for p in parts)
    length = int.from_bytes(wire[:4], "big")
    got = decode(wire[4 : 4 + length], bytearray(wire[4 + length :]))
    assert got.header == {"op": "push", "generation": 4, "losses": {"3": 0.25}}
    assert [e for e, _ in got.tensors] == [e for e, _ in sent.tensors]
    for (_, a), (_, b) in zip(sent.tensors, got.tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert json.loads(wire[4 : 4 + length])["tensors"][0] == [
        "grad",
        3,
        "conv.weight",
        "torch.float32",
        [4, 3, 3, 3],
    ]


def test_answers_come_in_order_and_match_what_was_sent(echo: Served) -> None:
    link = ShardLink(echo.address, timeout=5)
    try:
        first = Frame({"op": "a", "generation": 1}, tensors()[:1])
        second = Frame({"op": "b", "generation": 1}, tensors()[3:4])
        link.send(first)
        link.send(second)  # a second frame before the first answer is read (the batches ahead)
        assert link.pending == 2
        a, b = link.receive(), link.receive()
        assert a.header["echo"]["op"] == "a" and b.header["echo"]["op"] == "b"
        assert torch.equal(a.tensors[0][1], first.tensors[0][1])
        assert torch.equal(b.tensors[0][1], second.tensors[0][1])
        assert link.pending == 0
    finally:
        link.close()


@pytest.mark.parametrize("count", [1500, 3000])
def test_a_frame_of_more_tensors_than_one_sendmsg_takes_goes_both_ways(echo: Served, count: int) -> None:
    """Linux takes at most 1024 buffers in one `sendmsg`; a frame has one per tensor (the gradients of a
    model of 500 tensors over 3 micro-batches are 1500). Both sides send such a frame in batches."""
    link = ShardLink(echo.address, timeout=10)
    try:
        sent = [(Entry("grad", i % 3, f"p{i}"), torch.full((i % 5 + 1,), float(i))) for i in range(count)]
        got = link.request(Frame({"op": "push", "generation": 1}, sent))
        assert len(got.tensors) == count
        for (e, a), (f, b) in zip(sent, got.tensors, strict=True):
            assert e == f and torch.equal(a, b)
    finally:
        link.close()


def test_an_answer_leaves_as_it_was_when_the_handler_returned() -> None:
    """A shard answers with its live parameters (async mode) and changes them at the next apply, on the
    same event loop. An answer larger than the socket's buffer cannot leave in one write: what is left
    must be copied before the server awaits, or the loop gets half old and half new parameters."""
    live = torch.ones(8 << 20)  # 32 MB: far more than a socket's buffer

    async def handler(frame: Frame) -> Frame:
        # The next thing this event loop runs once the server awaits: an apply.
        asyncio.get_running_loop().call_soon(live.fill_, 2.0)
        return Frame({"ok": True}, [(Entry("state", -1, "w"), live)])

    served = Served(handler)
    link = ShardLink(served.address, timeout=10)
    try:
        got = link.request(Frame({"op": "current", "generation": 1}))
        assert torch.equal(got.tensors[0][1], torch.ones(8 << 20))
        assert live[0].item() == 2.0  # (the change did come, after the answer was taken)
    finally:
        link.close()
        served.close()


def test_an_unchanging_answer_larger_than_the_socket_buffer_arrives_whole() -> None:
    """A replica's tensors never change, so the server sends them from their own memory across awaits
    (`Frame.unchanging`) instead of copying what the socket did not take at once."""
    held = torch.arange(8 << 20, dtype=torch.float32)  # 32 MB

    async def handler(frame: Frame) -> Frame:
        return Frame({"ok": True}, [(Entry("replica", 0, ""), held)], unchanging=True)

    served = Served(handler)
    link = ShardLink(served.address, timeout=10)
    try:
        for _ in range(2):
            got = link.request(Frame({"op": "replica", "generation": 1}))
            assert torch.equal(got.tensors[0][1], held)
    finally:
        link.close()
        served.close()


def test_a_loop_on_the_shards_machine_uses_its_unix_socket_and_from_elsewhere_tcp(echo: Served) -> None:
    """Same frames either way; the Unix socket (abstract namespace) only where the loop can reach it."""
    assert echo.address.local, "a server without TLS on Linux listens on a Unix socket too"
    near = ShardLink(echo.address, timeout=5)
    far = ShardLink(echo.address._replace(local=""), timeout=5)  # as a loop on another machine sees it
    try:
        for link in (near, far):
            sent = Frame({"op": "push", "generation": 1}, tensors())
            got = link.request(sent)
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sent.tensors, got.tensors, strict=True))
        assert near.local and not far.local
        assert echo.server.connections == {"local": 1, "tcp": 1}
    finally:
        near.close()
        far.close()


def test_a_unix_socket_out_of_reach_falls_back_to_tcp_and_is_not_tried_again(echo: Served) -> None:
    """A loop in another network namespace (a container, another machine) cannot reach the name: its
    connect fails at once, and it uses TCP from then on."""
    link = ShardLink(echo.address._replace(local=f"prefect-elastic-not-here-{os.getpid()}"), timeout=5)
    try:
        assert link.request(Frame({"op": "a"})).header["echo"]["op"] == "a"
        assert not link.local
        link.close()
        assert link.request(Frame({"op": "b"})).header["echo"]["op"] == "b"
        assert echo.server.connections == {"local": 0, "tcp": 2}
    finally:
        link.close()


@pytest.mark.parametrize(
    ("op", "error", "text"),
    [
        ("stale", StaleGenerationError, "generation 1, current generation is 2"),
        ("wait", RecoverableError, "not applied yet"),
        ("fatal", FatalError, "batch 7 lives on data server 1"),
        ("bug", RuntimeError, "KeyError"),
    ],
)
def test_a_shards_error_comes_back_as_its_type(echo: Served, op: str, error: type, text: str) -> None:
    link = ShardLink(echo.address, timeout=5)
    try:
        with pytest.raises(error, match=text) as caught:
            link.request(Frame({"op": op, "generation": 1}))
        if op == "stale":
            assert isinstance(caught.value, StaleGenerationError) and caught.value.current == 2
        # The connection is still in step: the next frame gets its own answer.
        assert link.request(Frame({"op": "ok", "generation": 1})).header["echo"]["op"] == "ok"
    finally:
        link.close()


def test_a_timeout_closes_the_connection_and_the_next_frame_opens_another(echo: Served) -> None:
    link = ShardLink(echo.address, timeout=5)
    try:
        with pytest.raises(TimeoutError):
            link.request(Frame({"op": "slow", "seconds": 1.0}), timeout=0.1)
        assert link.pending == 0, "a connection that timed out is dropped, never read again"
        # The late answer of the slow frame must not be taken for this one's.
        assert link.request(Frame({"op": "after"})).header["echo"]["op"] == "after"
    finally:
        link.close()


def test_an_interrupt_wakes_a_read_in_another_thread_and_the_next_frame_opens_another(echo: Served) -> None:
    """An async session that ends while its exchange thread waits for a shard's answer interrupts the
    connection (`ShardLink.interrupt`): the waiting read fails at once, not at its timeout, and the
    connection, closed, is opened again by the next frame, whose answer is its own."""
    link = ShardLink(echo.address, timeout=30)
    failed: list[BaseException] = []

    def wait_for_a_slow_answer() -> None:
        try:
            link.request(Frame({"op": "slow", "seconds": 20.0}))
        except BaseException as exc:
            failed.append(exc)

    reader = threading.Thread(target=wait_for_a_slow_answer)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while not link.pending and time.monotonic() < deadline:  # the frame is sent, its answer awaited
            time.sleep(0.01)
        link.interrupt()
        reader.join(5)
        assert not reader.is_alive(), "the interrupt woke the read long before its 20 s"
        assert failed and isinstance(failed[0], OSError), failed
        link.close()
        assert link.request(Frame({"op": "after"})).header["echo"]["op"] == "after"
    finally:
        link.close()
        reader.join(30)


def test_nothing_listening_fails_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    link = ShardLink(("127.0.0.1", port), timeout=5)
    with pytest.raises(ConnectionRefusedError):
        link.request(Frame({"op": "x"}))
    assert link.pending == 0


def test_frames_that_follow_an_answer_are_counted_and_one_refused_in_their_place_ends_them() -> None:
    """An answer may promise frames after it (`follow`, a pull's buckets): the link owes them as answers;
    one that fails to be made comes as its error instead, saying how many will not come (`unsent`), so
    nothing is left owed and the connection carries on. A body may be read into the caller's memory."""

    async def handler(frame: Frame) -> Frame:
        if frame.header["op"] != "pull":
            return Frame({"ok": True, "echo": frame.header["op"]})

        def buckets() -> Iterator[Frame]:
            yield Frame({"ok": True, "bucket": 0}, [(Entry("params", 0, ""), torch.arange(4.0))])
            raise StaleGenerationError(1, 2, "pull")  # (a fence between two buckets)

        return Frame({"ok": True, "follow": 3}, following=buckets())

    served = Served(handler)
    link = ShardLink(served.address, timeout=5)
    try:
        link.request(Frame({"op": "pull", "generation": 1}))
        assert link.pending == 3
        into = np.zeros(16, dtype=np.uint8)
        first = link.receive(into=into)
        run = first.tensors[0][1]
        assert torch.equal(run, torch.arange(4.0)) and run.data_ptr() == into.ctypes.data
        with pytest.raises(StaleGenerationError):
            link.receive()
        assert link.pending == 0  # (the third will not come)
        assert link.request(Frame({"op": "next", "generation": 1})).header["echo"] == "next"
    finally:
        link.close()
        served.close()
