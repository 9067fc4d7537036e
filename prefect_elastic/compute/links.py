"""The connections of the compute loops running in this process, by job id (`_LINKS`), so that the
controller can wake a loop blocked on a shard whose role moved (`leave_links`, run on the worker through
`Client.run`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..wire import ChannelAddress, ShardLink

_LINKS_LOCK = threading.Lock()
# Each loop's lists of connections, which it changes in place as shards move.
_LINKS: dict[str, list[list[ShardLink]]] = {}


@contextlib.contextmanager
def registered(job_id: str, *loop_links: list[ShardLink]) -> Iterator[None]:
    """`loop_links` (one loop's lists of connections) known to `leave_links` while the loop runs."""
    with _LINKS_LOCK:
        _LINKS.setdefault(job_id, []).extend(loop_links)
    try:
        yield
    finally:
        with _LINKS_LOCK:
            mine = _LINKS.get(job_id, [])
            mine[:] = [links for links in mine if all(links is not own for own in loop_links)]
            if not mine:
                _LINKS.pop(job_id, None)


def leave_links(job_id: str, channels: Sequence[Sequence[Any]]) -> int:
    """Runs on a compute worker (`Client.run`, from the controller) once data servers' roles moved to
    standbys: wakes every loop of `job_id` blocked on a connection to one of the old `channels`; it then
    asks the coordinator for its role, which names where the shards listen now. Returns how many
    connections it broke.

    A frozen (or cut-off) static worker's kernel keeps its connections open, so a loop waiting for its
    answer would wait out `call_timeout` (30 s by default) after its role had long moved; a killed one's
    connections close by themselves."""
    moved = {ChannelAddress(*channel) for channel in channels}
    broken = 0
    with _LINKS_LOCK:
        links = [link for loop in _LINKS.get(job_id, []) for link in loop]
    for link in links:
        if link.address in moved:
            link.interrupt()
            broken += 1
    return broken
