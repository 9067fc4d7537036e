"""The sockets under the step path's channel (`channel.py`): blocking sends and reads for a compute loop's
link, and the shard server's two kinds of connection (plain, through the event loop's socket calls; TLS,
through asyncio streams) with its frame reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections import deque
from collections.abc import Sequence

from .codec import _LENGTH, MAX_HEADER_BYTES, Frame, _body_buffer, _body_size, decode
from .inbox import SharedBodies

# Socket buffers asked for on both ends: a frame of a few megabytes (a shard's share of a model's
# gradients) then moves in a few large reads instead of many small ones (the kernel caps the size at
# net.core.rmem_max / wmem_max). Measured: a 1.3 MB exchange from 1.59 to 1.36 ms here.
SOCKET_BUFFER_BYTES = 4 << 20

# Buffers one `sendmsg` is given at most: Linux refuses more than 1024 ("Message too long"), and a frame
# has a buffer per tensor (a big model's gradients of a few micro-batches are thousands).
MAX_BUFFERS_PER_SEND = 512


def _tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # No Nagle: a frame is written whole, and waiting to coalesce would only delay the answer.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def _send_all(sock: socket.socket, parts: Sequence[memoryview]) -> None:
    if isinstance(sock, ssl.SSLSocket):
        for part in parts:  # (a TLS socket has no sendmsg: each buffer is encrypted on its own)
            sock.sendall(part)
        return
    pending = _unsent(parts)
    while pending:
        _drop_sent(pending, sock.sendmsg(_next_buffers(pending)))


def _unsent(parts: Sequence[memoryview]) -> deque[memoryview]:
    return deque(p.cast("B") for p in parts if p.nbytes)


def _next_buffers(pending: deque[memoryview]) -> list[memoryview]:
    return [pending[i] for i in range(min(len(pending), MAX_BUFFERS_PER_SEND))]


def _drop_sent(pending: deque[memoryview], sent: int) -> None:
    """Takes the first `sent` bytes off `pending`."""
    while sent:
        if sent >= pending[0].nbytes:
            sent -= pending.popleft().nbytes
        else:
            pending[0] = pending[0][sent:]
            sent = 0


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the shard closed the connection")
        view = view[got:]


class _SocketIO:
    """A plain connection, through the event loop's socket calls: reads land in the frame's buffer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        self.loop = loop
        self.conn = conn

    async def read_into(self, view: memoryview, eof_ok: bool = False) -> bool:
        first = True
        while view.nbytes:
            got = await self.loop.sock_recv_into(self.conn, view)
            if not got:
                if first and eof_ok:
                    return False
                raise ConnectionError("the connection closed mid-frame")
            first = False
            view = view[got:]
        return True

    async def write(self, parts: list[memoryview], unchanging: bool = False) -> None:
        # One `sendmsg` for the whole frame where the socket's buffer takes it (an answer of a few
        # kilobytes always does): one system call, not one per tensor.
        pending = _unsent(parts)
        while pending:
            try:
                _drop_sent(pending, self.conn.sendmsg(_next_buffers(pending)))
            except (BlockingIOError, InterruptedError):
                # The buffer is full: what is left is copied (the tensors may change once this awaits,
                # unless the answer says they never do), and asyncio's own send waits until the socket
                # drains.
                for part in list(pending) if unchanging else [bytes(p) for p in pending]:
                    await self.loop.sock_sendall(self.conn, part)
                return

    def close(self) -> None:
        self.conn.close()


class _StreamIO:
    """A TLS connection, through asyncio streams (one copy more per read than `_SocketIO`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def read_into(self, view: memoryview, eof_ok: bool = False) -> bool:
        try:
            data = await self.reader.readexactly(view.nbytes)
        except asyncio.IncompleteReadError as short:
            if eof_ok and not short.partial:
                return False
            raise ConnectionError("the connection closed mid-frame") from short
        view[:] = data
        return True

    async def write(self, parts: list[memoryview], unchanging: bool = False) -> None:
        # Copies (unless the tensors never change): the transport may keep what it cannot encrypt and send
        # at once, past this await.
        self.writer.writelines(parts if unchanging else [bytes(p) for p in parts])
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


async def _read_frame(io: _SocketIO | _StreamIO, shared: SharedBodies) -> Frame | None:
    head = bytearray(_LENGTH.size)
    if not await io.read_into(memoryview(head), eof_ok=True):
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {length} bytes")
    header_bytes = bytearray(length)
    await io.read_into(memoryview(header_bytes))
    header = json.loads(header_bytes)
    body = shared.incoming(header, _body_size(header["tensors"]))
    if body is None:
        body = _body_buffer(header["tensors"])
        await io.read_into(body.data)
    return decode(header, body)  # (a shard reads nothing in a loop's memory)
