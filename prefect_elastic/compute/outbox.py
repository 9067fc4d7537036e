"""The loop's outbox for the overlapped step: a bucket's frame leaves from a thread of its link while
backward goes on, and the step's seals wait until every part is written (docs/design/overlapped-step.md).

Why a thread per link: the bucket hooks (`buckets.py`) run inside autograd, in the loop's thread on a
CPU; writing a 9 MB bucket there (a copy into the shard's inbox, or `sendmsg`) would stop backward for as
long. Both release the GIL, so a sender thread writes while backward computes. Why `drain` before the
seals: a shard commits a step once every id of it is sealed, so no seal may leave while a part of the
step is still queued for any shard; else a kill could leave one shard with all its seals and another
without a part, a version apart.

Used by `bucket_push.py` where a job sets `overlap_push`; each writer posts a frame to its shard.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ..wire.signals import RecoverableError

Item = TypeVar("Item")


class Outbox(Generic[Item]):
    """One sender thread per link of `writers`, each writing its items in the order they were put."""

    def __init__(self, writers: Sequence[Callable[[Item], None]], name: str = "outbox") -> None:
        self._writers = list(writers)
        self._queues: list[deque[Item]] = [deque() for _ in self._writers]
        self._lock = threading.Condition()
        self._pending = 0  # items put and not yet written (or dropped after an error)
        self._error: BaseException | None = None
        self._closed = False
        self._threads = [
            threading.Thread(target=self._send, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(len(self._writers))
        ]
        for thread in self._threads:
            thread.start()

    def put(self, link: int, item: Item) -> None:
        """Queue `item` for link `link`. After a writer's error (the step has failed) or once closed, the
        item is dropped: `put` runs inside backward (a hook), where an exception would be taken for the
        model's; `drain` raises the writer's error once backward is over."""
        with self._lock:
            if self._error is not None or self._closed:
                return
            self._queues[link].append(item)
            self._pending += 1
            self._lock.notify_all()

    @property
    def broken(self) -> bool:
        """Whether a writer raised, or items are still queued or being written."""
        with self._lock:
            return self._error is not None or self._pending > 0

    @property
    def pending(self) -> int:
        """Items put and not yet written."""
        with self._lock:
            return self._pending

    def drain(self, timeout: float) -> None:
        """Wait until every item put so far is written; raise the first error a writer raised, or a
        RecoverableError after `timeout` seconds (a shard that stopped reading: nothing hangs)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoverableError(f"{self._pending} frames not written within {timeout} s")
                self._lock.wait(left)
            if self._error is not None:
                raise self._error

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads once what they are writing is written; the rest is dropped."""
        with self._lock:
            self._closed = True
            for queue in self._queues:
                self._pending -= len(queue)
                queue.clear()
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def _send(self, link: int) -> None:
        queue = self._queues[link]
        while True:
            with self._lock:
                while not queue and not self._closed:
                    self._lock.wait()
                if self._closed and not queue:
                    return
                item = queue.popleft()
            try:
                if self._error is None:
                    self._writers[link](item)
            except BaseException as exc:  # (handed to the loop's thread by `drain` and `put`)
                with self._lock:
                    if self._error is None:
                        self._error = exc
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()
