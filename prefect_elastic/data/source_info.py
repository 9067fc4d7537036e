"""What a source is, as the controller learns it before any cluster work (`SourceInfo`, its `FieldInfo`s),
and what every kind of source offers once opened (`Source`).

The kinds' own modules (`npz_source`, `parquet_source`, `datasets_folder`, `factory_source`) build these;
`sources` picks the kind from a setting's value. A `SourceInfo` crosses processes (it is all a data server
or a compute worker gets to open the source with), so it is frozen and holds only picklable values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from ..errors import JobConfigError

__all__ = ["DATA_EXTRA", "FieldInfo", "Source", "SourceInfo", "SourceKind", "refusal"]

SourceKind = Literal["npz", "parquet", "datasets", "factory"]
# What to install for the optional readers (pyarrow for Parquet and `datasets` folders).
DATA_EXTRA = "pip install 'prefect-elastic[data]'"


@dataclass(frozen=True)
class FieldInfo:
    """One field of a sample: a column, an npz array, a key or position of a factory's items."""

    name: str
    # The per-sample shape when every sample has it; None where it varies (token lists) or is unknown (a
    # factory's fields: only item 0 is looked at).
    shape: tuple[int, ...] | None
    # The numpy dtype str ("<i8"); None where unknown or not a numeric array (strings, images as bytes).
    dtype: str | None

    @property
    def fixed(self) -> bool:
        """Numeric with one shape for every sample: its rows stack into one array."""
        return self.shape is not None and self.dtype is not None


@dataclass(frozen=True)
class SourceInfo:
    """A source as `inspect_source` found it, from its headers and metadata alone."""

    setting: str  # the job setting it came from ("dataset"): every error names it
    url: str  # the setting's value: a URL, or "module:factory"
    kind: SourceKind
    length: int  # samples
    fields: tuple[FieldInfo, ...]  # in item order
    tuple_items: bool  # items are tuples (a factory's): the fields are named by position, "0", "1", ...
    # Rows of each block in order: the unit read at once (an npz file's chunk, a Parquet row group, an
    # Arrow record batch); () for a factory, which is read by sample.
    blocks: tuple[int, ...]
    object_store: bool  # on S3, GCS, ...: random access is costly, so the schedule shuffles by blocks
    # fsspec keyword arguments for the URL (an S3 endpoint, keys): every process that opens it needs them.
    storage_options: dict[str, Any] = field(default_factory=dict, hash=False, repr=False)
    detail: tuple[Any, ...] = ()  # the kind's own, picklable: its files, their blocks, ...

    def field(self, name: str) -> FieldInfo | None:
        return next((f for f in self.fields if f.name == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def stackable(self) -> bool:
        """Every field numeric of one shape: `Source.rows` gives whole batches."""
        return self.kind != "factory" and all(f.fixed for f in self.fields)


class Source(Protocol):
    """An opened source (`open_source`), in the process that reads it.

    `items` gives the samples in the order asked: a columnar source one dict per sample, its values numpy
    arrays or numpy scalars of the column's dtype (never Python numbers, which `default_collate` would
    widen to float64 or int64), strings as `str`; a factory its items exactly as `dataset[i]` returns them.
    `rows` is the fast path of a source whose fields are all numeric of one shape: `{name: stacked rows}`,
    equal in values and dtypes to `default_collate(items(indices))`; None for any other source. Either may
    be called from one thread at a time besides the caller's own (a lock guards the open files).
    """

    info: SourceInfo

    def __len__(self) -> int: ...

    def items(self, indices: Sequence[int]) -> list[Any]: ...

    def rows(self, indices: Sequence[int]) -> dict[str, np.ndarray] | None: ...

    def close(self) -> None: ...


def refusal(setting: str, value: str, problem: str) -> JobConfigError:
    """The error of a source that cannot be trained on: names the setting, its value and what to do."""
    return JobConfigError(field=setting, value=value, problem=problem)
