"""What the controller asks of a worker process itself, outside any job's actors.

`load_engine` is the first task a worker runs for a job (the engine's import, in a task thread, so that
its event loop keeps sending heartbeats); `answering` asks which workers still answer a connection (for
survival detection, which must tell a worker lost with the others from one still there). Torch-free, as
everything in this package: a worker unpickles `load_engine` before it has imported torch.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
from collections.abc import Iterable
from typing import Any

from distributed.comm import parse_address, registry

# What a worker imports before it takes a role (`load_engine`): torch and the step path.
ENGINE_MODULES = ("prefect_elastic.compute", "prefect_elastic.data_server")


def load_engine(modules: tuple[str, ...] = ENGINE_MODULES) -> None:
    """Runs as a task on a worker before it takes a role: imports the engine (torch and the step path) in
    the worker's task thread.

    A task's arguments are unpickled on the worker's event loop, so the first compute loop or data server
    sent to a worker that has not imported torch yet imports it there, and the worker sends no heartbeat
    for as long (3 to 4 s on a small machine): a plain `dask worker` (no preload) would be taken for lost
    at the start of every run. Here the import runs in a thread, while the loop keeps answering; this
    function and its argument are plain names, so unpickling them imports nothing heavy (this module is
    torch-free).

    Then what those imports made is frozen (`gc.freeze`, after a collection), as
    `allocator.freeze_startup_objects` does after a compute loop's first step: that first full collection
    scans every object of torch and the engine (about 330,000, 0.3 s of CPU here) with the GIL held, so
    the worker's event loop sends no heartbeat meanwhile. After its first step it had made a member that
    just joined silent for 1.3 to 3.7 s under the chaos soak's load, and taken for lost; here the worker
    is not a member yet, and the later collection scans only what was made since."""
    for name in modules:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


async def answering(addresses: Iterable[str], timeout: float, **connection_args: Any) -> frozenset[str]:
    """The workers among `addresses` whose process answers a connection (Dask's handshake, which needs
    its event loop) within `timeout` seconds, all asked at once. A process killed with SIGKILL answers
    nothing, although its kernel may accept the connection for tens of milliseconds more: the sockets of a
    process that dies close only once its memory is torn down, which is also when the scheduler notices.
    So survival detection asks the members still listed whether they answer, to tell a worker lost with
    the others from one still there (`training.membership.wait_for_losses`). A frozen (SIGSTOPped)
    worker, one whose host lost power or is cut off, does not answer either: the caller then waits as if
    it were dying.
    One try each (Dask's `connect` retries a refused connection until its timeout), its connection closed
    whatever happens; nothing is sent after the handshake, and a live worker logs nothing for it. A live
    worker on the same machine answers in 0.7 to 2 ms (docs/benchmarks.md)."""

    async def one(address: str) -> str | None:
        comm = None
        try:
            scheme, location = parse_address(address)
            connector = registry.get_backend(scheme).get_connector()
            comm = await asyncio.wait_for(connector.connect(location, **connection_args), timeout)
            await asyncio.wait_for(comm.write(comm.handshake_info()), timeout)
            await asyncio.wait_for(comm.read(), timeout)
            return address
        except (TimeoutError, OSError, ValueError, TypeError):
            return None
        finally:
            if comm is not None:
                comm.abort()

    if timeout <= 0:
        return frozenset()
    got = await asyncio.gather(*(one(a) for a in addresses))
    return frozenset(a for a in got if a is not None)
