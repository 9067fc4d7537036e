"""Where the record batches of an Arrow IPC file are, found by reading only the messages' headers
(`scan_stream`), so that one batch can be read by its byte range (`read_batch`) from a local file or an
object store alike.

A `datasets` folder's `data-XXXXX-of-XXXXX.arrow` files are IPC *streams*: messages one after another,
each a small header (a continuation marker, the metadata's length, a flatbuffer `Message`) and a body
whose length the header gives. The header alone says what the message is (a schema, a dictionary, a record
batch) and, for a record batch, its rows; so the layout of a file is learned by reading each header and
seeking past its body: one small read per batch (a datasets shard of 500 MB in batches of 1,000 rows is
some hundred reads of a few KB, not 500 MB). pyarrow reads whole messages, bodies included, so the few
flatbuffer fields needed are read here (the Arrow columnar format's `Message.fbs`, stable since 1.0; the
pre-1.0 headers without the continuation marker are read too). An IPC *file* (`ARROW1` magic) is the same
stream after its magic, with a footer after the end marker.

A batch is then read from its bytes alone: the file's schema (and dictionaries, if any) come from the
messages before the first batch (`StreamLayout.prefix`), read once per open file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["StreamLayout", "read_batch", "read_schema", "scan_stream"]

_CONTINUATION = 0xFFFFFFFF
_FILE_MAGIC = b"ARROW1"
# MessageHeader's union tags (Message.fbs).
_SCHEMA, _DICTIONARY, _RECORD_BATCH = 1, 2, 3


@dataclass(frozen=True)
class StreamLayout:
    """The byte ranges of one IPC file's messages."""

    prefix: tuple[int, int]  # [start, stop) of the schema and dictionary messages before the first batch
    batches: tuple[tuple[int, int], ...]  # (start, length) of each record batch message
    rows: tuple[int, ...]  # rows of each record batch
    dictionaries: bool  # the prefix holds dictionaries: a batch is read behind them, as a stream


def _field(buf: bytes, table: int, index: int) -> int | None:
    """The position of field `index` of the flatbuffer table at `table`; None where it is absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vtable_size = struct.unpack_from("<H", buf, vtable)[0]
    entry = 4 + 2 * index
    if entry >= vtable_size:
        return None
    offset = struct.unpack_from("<H", buf, vtable + entry)[0]
    return table + offset if offset else None


def _message(buf: bytes) -> tuple[int, int, int]:
    """A `Message` flatbuffer's header type, body length and (for a record batch) rows."""
    root = struct.unpack_from("<I", buf, 0)[0]
    at = _field(buf, root, 1)  # header_type (ubyte)
    kind = buf[at] if at is not None else 0
    at = _field(buf, root, 3)  # bodyLength (long)
    body = struct.unpack_from("<q", buf, at)[0] if at is not None else 0
    rows = 0
    header = _field(buf, root, 2)  # header (a union's table, by offset)
    if kind == _RECORD_BATCH and header is not None:
        table = header + struct.unpack_from("<I", buf, header)[0]
        at = _field(buf, table, 0)  # RecordBatch.length (long)
        rows = struct.unpack_from("<q", buf, at)[0] if at is not None else 0
    return kind, body, rows


def _read_exactly(f: IO[bytes], n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"the file ends inside {what} ({len(data)} of {n} bytes)")
    return data


def scan_stream(f: IO[bytes]) -> StreamLayout:
    """The layout of the IPC stream (or file) open in `f`, from its messages' headers; ValueError where
    it is not one."""
    start = 0
    if _read_exactly(f, 8, "the first message")[:6] == _FILE_MAGIC:
        start = 8  # "ARROW1" and two bytes of padding, then a stream
    pos, prefix_stop = start, None
    batches: list[tuple[int, int]] = []
    rows: list[int] = []
    dictionaries = False
    while True:
        f.seek(pos)
        head = f.read(8)
        if len(head) < 4:
            break  # a stream may end without its end marker
        (first,) = struct.unpack_from("<I", head, 0)
        if first == _CONTINUATION:
            if len(head) < 8:
                break
            (size,) = struct.unpack_from("<i", head, 4)
            skip = 8
        else:
            size, skip = struct.unpack_from("<i", head, 0)[0], 4
        if size == 0:
            break  # the end-of-stream marker
        if size < 0:
            raise ValueError(f"a message at byte {pos} has a negative length {size}: not an Arrow IPC stream")
        f.seek(pos + skip)
        try:
            kind, body, count = _message(_read_exactly(f, size, f"the message at byte {pos}"))
        except struct.error as exc:
            raise ValueError(f"the message at byte {pos} is not an Arrow message ({exc})") from exc
        length = skip + size + body
        if kind == _RECORD_BATCH:
            prefix_stop = pos if prefix_stop is None else prefix_stop
            batches.append((pos, length))
            rows.append(count)
        elif kind == _DICTIONARY:
            if prefix_stop is not None:
                raise ValueError("it has dictionaries between its record batches, which are not read here")
            dictionaries = True
        elif kind != _SCHEMA:
            raise ValueError(f"the message at byte {pos} is of type {kind}, not of an Arrow table")
        pos += length
    if pos == start:
        raise ValueError("it holds no Arrow message")
    return StreamLayout(
        (start, pos if prefix_stop is None else prefix_stop), tuple(batches), tuple(rows), dictionaries
    )


def read_schema(pa: Any, prefix: Any) -> Any:
    """The schema of a stream, from the bytes of its prefix (a pyarrow Buffer or bytes)."""
    return pa.ipc.read_schema(pa.py_buffer(prefix) if isinstance(prefix, bytes) else prefix)


def read_batch(pa: Any, layout: StreamLayout, schema: Any, prefix: Any, message: Any) -> Any:
    """The record batch in `message` (the bytes of one batch message, a Buffer or bytes)."""
    if layout.dictionaries:
        # The dictionaries are read behind the prefix, as a stream of the prefix and this one batch.
        stream = pa.ipc.open_stream(pa.py_buffer(bytes(prefix) + bytes(message)))
        return stream.read_next_batch()
    buffer = pa.py_buffer(message) if isinstance(message, bytes) else message
    return pa.ipc.read_record_batch(pa.ipc.read_message(buffer), schema)
