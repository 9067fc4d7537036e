"""The step path's wire: one frame each way between a compute loop and a shard per step, over a TCP
connection of their own, beside Dask.

Why not Dask actor calls: a step needs the gradients to every shard and the next step's parameters and
batches back. As actor calls that was five calls a step (two pushes, two pulls, a batch fetch), each
hopping from the loop's thread to the worker's event loop, through Dask's message framing and its
serializers, and back: 8 to 13 ms a step on this machine whatever the model (docs/benchmarks.md). Here a
step is one frame to each shard (its gradients, the losses, and which step and batches the loop needs
next) and one frame back (the parameters of that step, once the shard has applied this one, and the
batches): a blocking socket in the loop's thread, and the shard's own event loop on the other side.

A frame is a JSON header and the raw bytes of its tensors, nothing pickled:

    !I header length | header (JSON, utf-8) | tensor bytes, back to back, in the header's order

The header names each tensor with `[kind, batch_id, name, dtype, shape]`; the receiver reads the whole
body into one buffer and makes every tensor a view of it (no copy). The control calls (fence, restore,
snapshot, status) stay Dask actor calls: they are rare, and the coordinator makes them.

Every message carries the generation (in its header), and every wait is bounded: a socket op by the
caller's timeout, a shard's wait for a step by the `wait` the frame names.

A loop on the same machine as the shard (in the same network namespace) connects to a Unix socket
instead (`ChannelAddress.local`, in Linux's abstract namespace: no file to clean up, gone with the
process): the same frames, without TCP's stack under them. A 1.3 MB frame each way took 0.17 ms instead
of 0.44 ms here. Elsewhere (another machine, a container with a network of its own) the connect fails at
once and the loop uses TCP.

When the cluster uses TLS (Dask's `Security`: workers started with `--tls-ca-file/--tls-cert/--tls-key`),
the connection uses it too, with the worker's own certificates (`worker_tls`): encrypted, and only a peer
with a certificate of the cluster's authority gets through the handshake. There is no Unix socket then:
any process of the machine may connect to one in the abstract namespace, and the handshake is what keeps
them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from ..errors import FatalError
from .codec import (
    _LENGTH,
    MAX_HEADER_BYTES,
    Frame,
    _body_buffer,
    _body_size,
    decode,
    encode,
    raise_error,
)
from .inbox import SharedBodies, peer_pid
from .sockets import _read_frame, _recv_exactly, _recv_into, _send_all, _SocketIO, _StreamIO, _tune
from .step_messages import Failed, frames_after, is_quiet


class ChannelAddress(NamedTuple):
    """Where a shard listens for compute loops: TCP on `host`:`port`, and, on Linux without TLS, a Unix
    socket named `local` in the abstract namespace ("" when none), which a loop on the same machine
    uses instead."""

    host: str
    port: int
    local: str = ""

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@contextlib.contextmanager
def unread_answers_dropped(links: Iterable[ShardLink]) -> Iterator[None]:
    """On an error inside the block, close every link that still owes an answer: an answer left unread
    would be taken for the next frame's."""
    try:
        yield
    except BaseException:
        for link in links:
            if link.pending:
                link.close()
        raise


class ShardLink:
    """A compute loop's connection to one shard. Frames are answered in the order they were sent, so a
    loop may send a second frame before it reads the first answer. Any error closes the connection (a
    half-read stream cannot be trusted), and the next `send` opens a new one."""

    def __init__(
        self, address: ChannelAddress | tuple[str, int], timeout: float, tls: ssl.SSLContext | None = None
    ) -> None:
        self.address = ChannelAddress(*address)
        self.timeout = timeout
        self.tls = tls
        self._sock: socket.socket | None = None
        self.pending = 0  # frames sent whose answer was not read yet
        self.local = False  # whether the connection is to the shard's Unix socket (the same machine)
        self.shared = SharedBodies()  # the connection's shared memory (`inbox.py`): on a Unix socket
        # Once that connect has failed (another machine, another network namespace), it is not tried again.
        self._local_refused = False

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = self._connect_local()
            self.local = sock is not None
            self.shared = SharedBodies(peer_pid(sock) if sock is not None else 0)
            if sock is None:
                sock = socket.create_connection((self.address.host, self.address.port), timeout=self.timeout)
                _tune(sock)
                if self.tls is not None:
                    try:
                        sock = self.tls.wrap_socket(sock, server_hostname=self.address.host)
                    except BaseException:
                        sock.close()
                        raise
            self._sock = sock
        return self._sock

    def _connect_local(self) -> socket.socket | None:
        if not self.address.local or self.tls is not None or self._local_refused:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect("\0" + self.address.local)
        except OSError:  # no such socket in this network namespace: not the shard's machine
            sock.close()
            self._local_refused = True
            return None
        _tune(sock)
        return sock

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self.pending = 0
        self.shared.close()

    def interrupt(self) -> None:
        """Wake a thread blocked on this connection (its call fails, and closes the connection)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def send(self, frame: Frame) -> None:
        try:
            sock = self._connected()
            sock.settimeout(self.timeout)
            _send_all(sock, encode(frame, self.shared))
            self.pending += 1
        except BaseException:
            self.close()
            raise

    def post(self, frame: Frame) -> None:
        """Send a frame the shard does not answer (its header says `quiet`): a bucket of gradients that
        leaves during backward. What became of it, the frame after it on this connection says."""
        if not is_quiet(frame.header):
            raise ValueError("post sends quiet frames only: the shard answers every other frame")
        try:
            sock = self._connected()
            sock.settimeout(self.timeout)
            _send_all(sock, encode(frame, self.shared))
        except BaseException:
            self.close()
            raise

    def receive(
        self, timeout: float | None = None, huge_pages: bool = True, into: np.ndarray | None = None
    ) -> Frame:
        """The next answer (in the order they were asked for: an answer's following frames, `follow` of
        them, count as answers to read too); raises what the shard raised (stale generation, not ready,
        fatal) as the same error type. `huge_pages=False`: read it into memory of 4 KiB pages (a one-off
        answer of hundreds of megabytes, see `_body_buffer`). `into`: bytes the body is read into (its
        tensors are views of them), where it has their size."""
        sock = self._sock
        if sock is None or not self.pending:
            raise ConnectionError(f"no request in flight to the shard at {self.address}")
        try:
            sock.settimeout(self.timeout if timeout is None else timeout)
            (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
            if length > MAX_HEADER_BYTES:
                raise ConnectionError(f"the shard at {self.address} sent a header of {length} bytes")
            header = json.loads(_recv_exactly(sock, length))
            size = _body_size(header["tensors"])
            body = self.shared.incoming(header, size)
            if body is not None and into is not None and len(into) == size:
                np.copyto(into, body)  # (from the shared inbox: one copy, as off the socket)
                body = into
            elif body is None:
                fits = into is not None and len(into) == size
                body = into if into is not None and fits else _body_buffer(header["tensors"], huge_pages)
                _recv_into(sock, body.data)
        except BaseException:
            self.close()
            raise
        # (An answer followed by frames of its own; an error in their place says how many will not come.)
        self.pending += frames_after(header) - 1
        frame = decode(header, body, self.shared.region)
        raise_error(frame.header)
        return frame

    def request(self, frame: Frame, timeout: float | None = None) -> Frame:
        self.send(frame)
        return self.receive(timeout)


def worker_tls(side: str) -> ssl.SSLContext | None:
    """The TLS context of the Dask worker this runs on (`side`: "listen" for a shard's server, "connect"
    for a compute loop), when its cluster uses TLS; None outside a worker or without TLS."""
    try:
        from distributed import get_worker

        security = get_worker().security
    except (ImportError, ValueError):
        return None
    if not (getattr(security, "tls_ca_file", None) and getattr(security, "tls_worker_cert", None)):
        return None
    args = security.get_listen_args("worker") if side == "listen" else security.get_connection_args("worker")
    context = args.get("ssl_context")
    return context if isinstance(context, ssl.SSLContext) else None


Handler = Callable[[Frame], Awaitable[Frame]]


class ShardServer:
    """Listens on the static worker's host for compute loops; each connection is served in turn, one
    frame at a time, by `handler` on the worker's event loop (where the shard's actor methods run too, so
    the shard's state is only ever touched from that loop).

    An answer's tensors are sent, or copied, before the server awaits anything after `handler` returns:
    a handler may answer with tensors that it changes later on the same event loop."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self._listener: socket.socket | None = None
        self._local_listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._tls_server: asyncio.Server | None = None
        self.address: ChannelAddress | None = None
        # Seconds by phase, summed: `handle` (the handler, waits for other workers' pushes included) and
        # `send` (writing answers into the sockets).
        self.phases: dict[str, float] = {"handle": 0.0, "send": 0.0}
        self.frames = 0
        self.connections = {"tcp": 0, "local": 0}  # connections taken, by kind
        # Bodies received, by the way they came: through shared memory (`inbox.py`) or the socket.
        self.bodies = {"shared": 0, "socket": 0}

    async def start(self, host: str, tls: ssl.SSLContext | None = None, local: bool = True) -> ChannelAddress:
        """Listen on `host` (a free port); with `tls`, every connection is TLS with that context. Without
        it, and with `local` on Linux, on a Unix socket for loops on this machine too."""
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        name = ""
        if tls is None and local and sys.platform.startswith("linux"):
            name = f"prefect-elastic-{os.getpid()}-{uuid.uuid4().hex}"
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.bind("\0" + name)
            unix.listen(64)
            unix.setblocking(False)
            self._local_listener = unix
        self.address = ChannelAddress(host, int(listener.getsockname()[1]), name)
        if self._local_listener is not None:
            self._spawn(self._accept(self._local_listener, "local"))
        if tls is None:
            self._spawn(self._accept(listener, "tcp"))
        else:
            # asyncio's socket calls cannot speak TLS: a TLS connection is served through streams.
            async def serve_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                self.connections["tcp"] += 1
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    _tune(sock)
                await self._serve(_StreamIO(reader, writer), SharedBodies(0, self.bodies))

            self._tls_server = await asyncio.start_server(serve_stream, sock=listener, ssl=tls)
        return self.address

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket, kind: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError:
                return  # closed
            conn.setblocking(False)
            _tune(conn)
            self.connections[kind] += 1
            shared = SharedBodies(peer_pid(conn) if kind == "local" else 0, self.bodies, maps=False)
            self._spawn(self._serve(_SocketIO(loop, conn), shared))

    async def _serve(self, io: _SocketIO | _StreamIO, shared: SharedBodies) -> None:
        try:
            while True:
                frame = await _read_frame(io, shared)
                if frame is None:
                    return
                began = time.perf_counter()
                if is_quiet(frame.header):
                    # Unanswered (`ShardLink.post`): the handler keeps what went wrong for the next frame.
                    with contextlib.suppress(Exception):
                        await self.handler(frame)
                    self.phases["handle"] += time.perf_counter() - began
                    continue
                try:
                    answer = await self.handler(frame)
                except Exception as exc:
                    answer = Failed.because(exc).frame()
                handled = time.perf_counter()
                await io.write(encode(answer, shared), answer.unchanging)
                if answer.following is not None:
                    await self._write_following(io, shared, answer)
                self.phases["handle"] += handled - began
                self.phases["send"] += time.perf_counter() - handled
                self.frames += 1
        except (OSError, ConnectionError, ValueError, asyncio.IncompleteReadError):
            return  # the loop went away (killed, cancelled) or sent garbage: drop the connection
        finally:
            io.close()
            shared.close()

    @staticmethod
    async def _write_following(io: _SocketIO | _StreamIO, shared: SharedBodies, answer: Frame) -> None:
        """The frames that follow `answer` (its header's `follow` of them), each written before the next is
        made, so that each is made from the shard's state of that moment. One that fails to be made is
        answered as its error, which also says how many promised frames will not come (`unsent`)."""
        assert answer.following is not None
        promised = frames_after(answer.header)
        for written in range(promised):
            failed = False
            try:
                frame = next(answer.following)
            except Exception as exc:  # (StopIteration too: a promise the maker did not keep)
                error = exc if not isinstance(exc, StopIteration) else FatalError("an answer ended early")
                frame, failed = Failed.because(error, promised - written - 1).frame(), True
            await io.write(encode(frame, shared), frame.unchanging)
            if failed:
                return

    def close(self) -> None:
        if self._tls_server is not None:
            self._tls_server.close()
            self._tls_server = None
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                listener.close()
        self._listener = self._local_listener = None
        for task in list(self._tasks):
            task.cancel()

    async def aclose(self) -> None:
        """`close`, then wait until every connection's task has ended."""
        tasks = list(self._tasks)
        self.close()
        await asyncio.gather(*tasks, return_exceptions=True)
