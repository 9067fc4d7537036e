"""Reading a columnar source block by block within a memory bound: the decoded columns of a block
(`FixedColumn`, `RaggedColumn`, `ObjectColumn`), the bounded cache of decoded blocks (`BlockCache`), and
the `items` and `rows` that every columnar kind shares (`ColumnarSource`).

A kind (npz, Parquet, a `datasets` folder) only says how one block is decoded (`ColumnarSource.load`).
The samples asked for are grouped by block, each block decoded at most once per call, and what is handed
out is copied from the block: nothing returned keeps a block alive after the cache lets it go, so a
reader's memory stays at the cache's bound plus the one block in hand.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .source_info import SourceInfo

__all__ = ["BlockCache", "ColumnarSource", "DecodedBlock", "FixedColumn", "ObjectColumn", "RaggedColumn"]


@dataclass(frozen=True)
class FixedColumn:
    """A numeric column of one shape per row: the block's rows stacked, `(rows, *shape)`."""

    array: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def row(self, j: int) -> Any:
        # A 1-d column's row is a numpy scalar (np.int64, np.float32): its dtype survives default_collate.
        value = self.array[j]
        return value.copy() if isinstance(value, np.ndarray) else value

    def take(self, positions: np.ndarray) -> np.ndarray:
        return self.array[positions]


@dataclass(frozen=True)
class RaggedColumn:
    """Rows of varying length (token ids): the values one after another, row j at `offsets[j]:offsets[j+1]`
    along the first axis of `values` (whose further axes, if any, are fixed)."""

    values: np.ndarray
    offsets: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.offsets.nbytes)

    def row(self, j: int) -> Any:
        return self.values[int(self.offsets[j]) : int(self.offsets[j + 1])].copy()


@dataclass(frozen=True)
class ObjectColumn:
    """Anything else, as Python values (strings, a `datasets` Image's bytes): passed through as they are."""

    values: list[Any]
    size: int  # bytes, as the decoder measured them

    @property
    def nbytes(self) -> int:
        return self.size

    def row(self, j: int) -> Any:
        return self.values[j]


Column = FixedColumn | RaggedColumn | ObjectColumn


@dataclass(frozen=True)
class DecodedBlock:
    """One block's columns by field name, each with the block's rows."""

    columns: dict[str, Column]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.columns.values())


class BlockCache:
    """Decoded blocks, least recently used first out, never more than `most_bytes` of them together.

    A block larger than the bound is handed out but not kept: the bound holds whatever the blocks are.
    """

    def __init__(self, most_bytes: int) -> None:
        if most_bytes < 0:
            raise ValueError(f"cache_bytes must not be negative, got {most_bytes}")
        self.most_bytes = most_bytes
        self._blocks: OrderedDict[int, DecodedBlock] = OrderedDict()
        self._bytes = 0
        self.loads = 0  # blocks decoded (a measure of the cache's use in tests and benchmarks)

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def get(self, index: int, load: Callable[[int], DecodedBlock]) -> DecodedBlock:
        block = self._blocks.get(index)
        if block is not None:
            self._blocks.move_to_end(index)
            return block
        block = load(index)
        self.loads += 1
        size = block.nbytes
        if size <= self.most_bytes:
            while self._blocks and self._bytes + size > self.most_bytes:
                _, old = self._blocks.popitem(last=False)
                self._bytes -= old.nbytes
            self._blocks[index] = block
            self._bytes += size
        return block

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0


class ColumnarSource:
    """The `Source` of a kind read by blocks: `items` and `rows` over its decoded blocks.

    A subclass decodes one block (`load`) and closes its files (`close_files`); both run under `lock`, so
    a file handle is never used by two threads at once.
    """

    def __init__(self, info: SourceInfo, cache_bytes: int) -> None:
        self.info = info
        self.cache_bytes = cache_bytes
        self.cache = BlockCache(cache_bytes)
        self.lock = threading.RLock()
        self.names = tuple(f.name for f in info.fields)
        # The first global index of each block, to find a sample's block by bisection.
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(info.blocks, dtype=np.int64))])

    def __len__(self) -> int:
        return self.info.length

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to another process, it is opened anew there (its files and cache are this process's).
        return (type(self), (self.info, self.cache_bytes))

    @property
    def cached_bytes(self) -> int:
        return self.cache.cached_bytes

    def load(self, block: int) -> DecodedBlock:
        raise NotImplementedError

    def close_files(self) -> None:
        """Close the open files (they open again, lazily, on the next read)."""

    def close(self) -> None:
        with self.lock:
            self.cache.clear()
            self.close_files()

    def by_block(self, indices: Sequence[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The asked samples grouped by block: for each block, the positions in the answer and the rows
        within the block."""
        wanted = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(wanted) and (int(wanted.min()) < 0 or int(wanted.max()) >= self.info.length):
            bad = next(int(i) for i in wanted if not 0 <= i < self.info.length)
            raise IndexError(f"sample {bad} is outside {self.info.setting}'s [0, {self.info.length})")
        blocks = np.searchsorted(self.starts, wanted, side="right") - 1
        groups: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        order = np.argsort(blocks, kind="stable")
        bounds = np.flatnonzero(np.diff(blocks[order])) + 1
        for positions in np.split(order, bounds) if len(order) else []:
            block = int(blocks[positions[0]])
            groups[block] = (positions, wanted[positions] - self.starts[block])
        return groups

    def items(self, indices: Sequence[int]) -> list[Any]:
        out: list[Any] = [None] * len(indices)
        with self.lock:
            for block, (positions, rows) in self.by_block(indices).items():
                columns = self.cache.get(block, self.load).columns
                for position, j in zip(positions.tolist(), rows.tolist(), strict=True):
                    out[position] = {name: columns[name].row(j) for name in self.names}
        return out

    def rows(self, indices: Sequence[int]) -> dict[str, np.ndarray] | None:
        if not self.info.stackable:
            return None
        out = {
            f.name: np.empty((len(indices), *(f.shape or ())), dtype=np.dtype(f.dtype))
            for f in self.info.fields
        }
        with self.lock:
            for block, (positions, rows) in self.by_block(indices).items():
                columns = self.cache.get(block, self.load).columns
                for name, array in out.items():
                    column = columns[name]
                    assert isinstance(column, FixedColumn)  # (every field is fixed: `stackable`)
                    array[positions] = column.take(rows)
        return out
