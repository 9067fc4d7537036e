"""The loop's outbox for the overlapped step (`compute/outbox.py`), with real threads: each link's items
written in the order they were put, `drain` returning only once all are written (so the seals can
follow), a writer that stopped making `drain` fail instead of hang, a writer's error handed back."""

from __future__ import annotations

import threading
import time

import pytest

from prefect_elastic.compute.outbox import Outbox
from prefect_elastic.wire.signals import RecoverableError


def test_each_links_items_are_written_in_order_and_drain_waits_for_all() -> None:
    written: list[list[int]] = [[], []]
    outbox: Outbox[int] = Outbox([written[0].append, written[1].append])
    for i in range(50):
        outbox.put(i % 2, i)
    outbox.drain(timeout=30)
    assert outbox.pending == 0
    assert written == [list(range(0, 50, 2)), list(range(1, 50, 2))]
    outbox.close()


def test_drain_does_not_return_while_a_part_is_unwritten() -> None:
    # Link 1's writer is held inside its write: however fast the machine, drain cannot have everything.
    started, release = threading.Event(), threading.Event()
    written: list[str] = []

    def slow(item: str) -> None:
        started.set()
        release.wait()
        written.append(item)

    outbox: Outbox[str] = Outbox([written.append, slow])
    outbox.put(0, "part to shard 0")
    outbox.put(1, "part to shard 1")
    assert started.wait(30)
    with pytest.raises(RecoverableError, match="1 frames not written"):
        outbox.drain(timeout=0.01)
    assert "part to shard 1" not in written  # (no seal may leave now)
    release.set()
    outbox.drain(timeout=30)
    assert sorted(written) == ["part to shard 0", "part to shard 1"]
    outbox.close()


def test_a_writers_error_comes_back_from_drain_and_later_items_are_dropped() -> None:
    """`put` runs inside backward (a hook), where an exception would be taken for the model's: after a
    writer's error it drops what it is given, and `drain` raises the error."""
    written: list[int] = []

    def broken(item: int) -> None:
        if item == 3:
            raise ConnectionResetError("shard gone")
        written.append(item)

    outbox: Outbox[int] = Outbox([broken])
    for i in range(3):
        outbox.put(0, i)
    outbox.drain(timeout=30)
    assert not outbox.broken
    outbox.put(0, 3)
    with pytest.raises(ConnectionResetError):
        outbox.drain(timeout=30)
    assert outbox.broken
    outbox.put(0, 4)  # (dropped, no exception)
    with pytest.raises(ConnectionResetError):
        outbox.drain(timeout=30)
    assert written == [0, 1, 2]
    outbox.close()


def test_close_drops_what_is_queued_and_ends_the_threads() -> None:
    started, release = threading.Event(), threading.Event()
    written: list[int] = []

    def held(item: int) -> None:
        started.set()
        release.wait()
        written.append(item)

    outbox: Outbox[int] = Outbox([held])
    for i in range(5):
        outbox.put(0, i)
    assert started.wait(30)  # item 0 is being written, 1 to 4 wait in the queue
    closing = threading.Thread(target=outbox.close, kwargs={"timeout": 30})
    closing.start()
    for _ in range(100_000):  # (close has dropped the queue once it is marked closed)
        if outbox._closed:
            break
        time.sleep(0.001)
    assert outbox._closed
    release.set()
    closing.join(30)
    assert written == [0] and outbox.pending == 0
    assert all(not t.is_alive() for t in outbox._threads)
    outbox.put(0, 9)  # (dropped: closed)
    assert outbox.pending == 0 and written == [0]
