"""`.npz` files with arrays `x` and `y` (today's format, `dataset.py`'s) as a source read by blocks.

Inspecting is `dataset.inspect_dataset` (the npy headers only). A block is a run of rows of one file,
about 8 MiB of `x` and `y` together, read by seeking into the file's members (`dataset.load_partition`):
a stored (uncompressed, `numpy.savez`) member seeks for free; a compressed one (`numpy.savez_compressed`)
decompresses from its start up to the block at every read, so a large dataset is best written uncompressed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from fsspec.core import url_to_fs

from ..dataset import DatasetInfo, inspect_dataset, is_object_store, load_partition
from ..errors import JobConfigError
from .columns import ColumnarSource, DecodedBlock, FixedColumn
from .source_info import FieldInfo, SourceInfo, refusal

__all__ = ["BLOCK_BYTES", "NpzSource", "inspect_npz"]

BLOCK_BYTES = 8 * 2**20  # about this much of a file's rows is read at once


def _row_bytes(info: DatasetInfo) -> int:
    x = int(np.prod(info.x_shape, dtype=np.int64)) * np.dtype(info.x_dtype).itemsize
    y = int(np.prod(info.y_shape, dtype=np.int64)) * np.dtype(info.y_dtype).itemsize
    return max(1, x + y)


def inspect_npz(setting: str, value: str, storage_options: Mapping[str, Any]) -> SourceInfo:
    try:
        dataset = inspect_dataset(value, storage_options)
    except JobConfigError as exc:  # (its errors name "dataset": this source may be another setting's)
        raise refusal(setting, value, exc.problem) from exc
    per_block = max(1, BLOCK_BYTES // _row_bytes(dataset))
    blocks: list[int] = []
    for count in dataset.counts:
        full, rest = divmod(count, per_block)
        blocks.extend([per_block] * full + ([rest] if rest else []))
    fs, _ = url_to_fs(value, **dict(storage_options))
    return SourceInfo(
        setting=setting,
        url=value,
        kind="npz",
        length=dataset.total,
        fields=(
            FieldInfo("x", dataset.x_shape, dataset.x_dtype),
            FieldInfo("y", dataset.y_shape, dataset.y_dtype),
        ),
        tuple_items=False,
        blocks=tuple(blocks),
        object_store=is_object_store(fs),
        storage_options=dict(storage_options),
        detail=(dataset,),
    )


class NpzSource(ColumnarSource):
    """Reads blocks of rows of `.npz` files (`SourceInfo.detail`: the `DatasetInfo` of the files)."""

    def __init__(self, info: SourceInfo, cache_bytes: int) -> None:
        super().__init__(info, cache_bytes)
        (self.dataset,) = info.detail

    def load(self, block: int) -> DecodedBlock:
        start, stop = int(self.starts[block]), int(self.starts[block + 1])
        try:
            x, y = load_partition(self.dataset, start, stop)
        except JobConfigError as exc:
            raise ValueError(exc.problem) from exc
        arrays = {"x": x, "y": y}
        return DecodedBlock({name: FixedColumn(arrays[name]) for name in self.names})
