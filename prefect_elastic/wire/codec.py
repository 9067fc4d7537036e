"""The frames of the step path on the wire: a JSON header that describes the tensors, then their raw
bytes (`encode`, `decode`); an error travels as a header of its own (`error_header`; `error_of` and
`raise_error` read it), which the step channel's `Failed` answer carries (`step_messages.py`).
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import FatalError
from .inbox import SharedBodies
from .signals import BackupWanted, DataFailure, RecoverableError, StaleGenerationError, StepPassed

_LENGTH = struct.Struct("!I")  # a frame's header length, before the header
_DTYPES: dict[str, torch.dtype] = {}  # a header's dtype name -> the dtype (looked up once per name)
# A header is a few kilobytes at most (names of tensors, losses); anything larger is not a frame of ours.
MAX_HEADER_BYTES = 64 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of a frame: what it is (`kind`: param, grad, buffer, x, y), for which batch id (-1 when
    none) and under which name."""

    kind: str
    batch_id: int
    name: str


@dataclass
class Frame:
    header: dict[str, Any]
    tensors: list[tuple[Entry, torch.Tensor]] = field(default_factory=list)
    # An answer whose tensors nobody changes once the handler returned (a replica a peer holds): the
    # shard's server may then await with them unsent instead of copying what the socket did not take.
    # Not sent: it concerns the sender's memory only.
    unchanging: bool = False
    # Frames that follow this answer on the same connection, written one after another as the iterator
    # makes them (a pull's buckets, in forward order: `data_server/frames.py`); the header's `follow`
    # says how many. Not sent either.
    following: Iterator[Frame] | None = None


# Entries that a loop on the shard's machine reads in place, in the shard's memory, where the shard's
# tensor lies in a published region (`published.py`): the sync pull's parameters, which no shard changes
# while a loop of the generation still reads them. Never the async answers' `state`.
BY_REFERENCE = frozenset({"params"})


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype: {name!r}")
        _DTYPES[name] = dtype
    return dtype


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor with elements, without a copy."""
    try:
        # (numpy's view costs a third of torch's reshape, view and numpy: a frame has a tensor per
        # parameter, and a step encodes and decodes four frames.)
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
    except (TypeError, RuntimeError):  # a dtype numpy does not have (bfloat16), a tensor with a conj bit
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def encode(frame: Frame, shared: SharedBodies | None = None) -> list[memoryview]:
    """The frame as buffers to send in order; tensor bytes are views of the tensors' memory, not copies.
    With `shared` (the connection's shared memory, `inbox.py`), the body is copied into the peer's inbox
    where it can be, and only the header is left to send."""
    described = []
    bodies: list[memoryview] = []
    for entry, tensor in frame.tensors:
        t = tensor.detach() if tensor.requires_grad else tensor
        if not t.is_cpu:
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        reference = shared.reference(t) if shared is not None and entry.kind in BY_REFERENCE else None
        if reference is not None:  # (read in place by the peer: no bytes)
            described.append([entry.kind, entry.batch_id, entry.name, str(t.dtype), t.shape, *reference])
            continue
        described.append([entry.kind, entry.batch_id, entry.name, str(t.dtype), t.shape])
        if t.numel():
            bodies.append(_raw(t))
    fields: dict[str, Any] = {}
    if shared is not None:
        fields = shared.outgoing(bodies, sum(body.nbytes for body in bodies))
        if "slot" in fields:
            bodies = []
    header = json.dumps({**frame.header, **fields, "tensors": described}, separators=(",", ":")).encode()
    return [memoryview(_LENGTH.pack(len(header)) + header), *bodies]


def _count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _body_size(described: list[list[Any]]) -> int:
    # (An entry with a reference to published memory, `[..., key, offset]`, has no bytes in the body.)
    return sum(_count(shape) * _dtype(dtype).itemsize for _, _, _, dtype, shape, *ref in described if not ref)


def _body_buffer(described: list[list[Any]], huge_pages: bool = True) -> np.ndarray:
    # Not zero-filled (a bytearray is): every byte is overwritten by the read, and a mlp's frame is
    # megabytes, read every step. numpy asks the kernel for transparent huge pages for a large buffer
    # (a fresh 200 MB one is touched in 0.015 s instead of 0.04 s), but a kernel with no huge page free
    # first compacts memory, which took up to 0.4 s here: a one-off buffer (`huge_pages=False`) comes
    # from torch's allocator, which asks for no huge pages (4 KiB pages: 0.04 s, and no compaction).
    size = _body_size(described)
    if huge_pages:
        return np.empty(size, dtype=np.uint8)
    return torch.empty(size, dtype=torch.uint8).numpy()


@functools.cache
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides, in elements (for `as_strided`, which makes a view in a third of
    the time `split` or slicing and `view` take)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * max(1, shape[i])
    return tuple(strides)


def decode(
    header: bytes | bytearray | dict[str, Any],
    body: bytearray | np.ndarray,
    regions: Callable[[str], torch.Tensor] | None = None,
) -> Frame:
    """The frame of a header (its JSON, or that already parsed) and its body, which the tensors are views
    of (no copy). An entry that refers to the peer's published memory is a view of it (`regions`: the
    bytes of a region by its key, `SharedBodies.region`)."""
    parsed: dict[str, Any] = header if isinstance(header, dict) else json.loads(header)
    described = parsed.pop("tensors")
    tensors: list[tuple[Entry, torch.Tensor]] = []
    # Every tensor a view of one tensor over the body: tensors that came back to back (a shard's
    # gradients of one micro-batch) then lie back to back in one storage, and a shard takes them as one
    # flat tensor without a copy (`data_server/optimizer.py`).
    whole: torch.Tensor | None = None
    if len(body):
        whole = (
            torch.from_numpy(body)
            if isinstance(body, np.ndarray)
            else torch.frombuffer(body, dtype=torch.uint8)
        )
    typed: dict[torch.dtype, torch.Tensor] = {}  # the body as elements of each dtype seen (aligned runs)
    offset = 0
    for kind, batch_id, name, dtype_name, shape, *reference in described:
        dtype = _dtype(dtype_name)
        count = _count(shape)
        itemsize = dtype.itemsize
        if reference:
            if kind not in BY_REFERENCE:
                raise ValueError(f"a frame refers to published memory for an entry of kind {kind!r}")
            tensors.append((Entry(kind, int(batch_id), name), _referred(regions, reference, dtype, shape)))
            continue
        if not count or whole is None:
            t = torch.empty(shape, dtype=dtype)
        elif offset % itemsize == 0:
            as_items = typed.get(dtype)
            if as_items is None:
                as_items = typed[dtype] = whole[: len(whole) - len(whole) % itemsize].view(dtype)
            t = as_items.as_strided(shape, contiguous_strides(tuple(shape)), offset // itemsize)
        else:  # (after an odd number of bytes: a view of another dtype must be aligned to its items)
            t = torch.frombuffer(body, dtype=dtype, count=count, offset=offset).view(shape)
        offset += count * itemsize
        tensors.append((Entry(kind, int(batch_id), name), t))
    return Frame(parsed, tensors)


def _referred(
    regions: Callable[[str], torch.Tensor] | None, reference: list[Any], dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    key, at = str(reference[0]), int(reference[1])
    if regions is None:
        raise ValueError(f"a frame refers to published memory ({key}) on a connection that maps none")
    data = regions(key)
    size = _count(shape) * dtype.itemsize
    if at < 0 or at + size > len(data) or at % dtype.itemsize:
        raise ValueError(f"a frame refers to bytes [{at}, {at + size}) of published memory of {len(data)}")
    return data[at : at + size].view(dtype).view(shape)


def error_header(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, StaleGenerationError):
        return {"error": "stale", "got": exc.got, "current": exc.current, "what": exc.what}
    if isinstance(exc, StepPassed):
        return {"error": "passed", "step": exc.step, "version": exc.version, "index": exc.index}
    if isinstance(exc, BackupWanted):
        return {"error": "backup", "step": exc.step, "batch_ids": list(exc.batch_ids)}
    if isinstance(exc, RecoverableError):
        return {"error": "recoverable", "message": str(exc)}
    if isinstance(exc, DataFailure):
        return {"error": "data", "step": exc.step, "batch_id": exc.batch_id, "message": str(exc)}
    if isinstance(exc, FatalError):
        return {"error": "fatal", "message": str(exc)}
    return {"error": "internal", "message": f"{type(exc).__name__}: {exc}"}


def error_of(header: dict[str, Any]) -> Exception | None:
    """The exception an error header says (None: the header is no error's), of the type the shard raised."""
    kind = header.get("error")
    if kind is None:
        return None
    if kind == "stale":
        return StaleGenerationError(int(header["got"]), int(header["current"]), str(header["what"]))
    if kind == "passed":
        return StepPassed(int(header["step"]), int(header["version"]), int(header["index"]))
    if kind == "backup":
        return BackupWanted(int(header["step"]), tuple(int(b) for b in header["batch_ids"]))
    if kind == "recoverable":
        return RecoverableError(str(header["message"]))
    if kind == "data":
        return DataFailure(int(header["step"]), int(header["batch_id"]), str(header["message"]))
    if kind == "fatal":
        return FatalError(str(header["message"]))
    return RuntimeError(f"the shard failed: {header.get('message')}")


def raise_error(header: dict[str, Any]) -> None:
    """Raise what an error header says (nothing where the header is no error's)."""
    error = error_of(header)
    if error is not None:
        raise error
