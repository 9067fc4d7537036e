"""Arrow columns as a sample's fields: a column's type as a `FieldInfo`, and a block's Arrow columns decoded
into numpy (`decode`), for both columnar kinds that pyarrow reads (Parquet, `datasets` folders).

pyarrow is an optional extra: `require_pyarrow` imports it, and says what to install where it is missing.

A column is fixed (`FixedColumn`) when its type gives every row one shape: a number, a fixed-size list of
numbers (`datasets`' `Sequence(length=k)`), or a `datasets` Array2D-5D of static shape (from its feature,
which the schema's metadata carries). A list of numbers of varying length (token ids) is ragged
(`RaggedColumn`): its shape is None, since knowing that all its rows happen to have one length would take a
read of the whole column. Anything else (strings, an Image's bytes, timestamps) passes as Python values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .columns import Column, DecodedBlock, FixedColumn, ObjectColumn, RaggedColumn
from .source_info import DATA_EXTRA, FieldInfo, refusal

__all__ = ["decode", "fields_of_schema", "hf_features", "require_pyarrow", "same_fields"]

# `datasets` features whose rows all have one shape, given as the feature's "shape".
_HF_ARRAYS = frozenset({"Array2D", "Array3D", "Array4D", "Array5D"})


def require_pyarrow(setting: str, value: str, what: str) -> Any:
    """The pyarrow module, or a refusal that says which extra to install."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise refusal(
            setting,
            value,
            f"is {what}, which is read with pyarrow, and pyarrow is not installed here ({exc}); "
            f"install it on this machine and on every Dask worker: {DATA_EXTRA}",
        ) from exc
    return pyarrow


@dataclass(frozen=True)
class _Levels:
    """An Arrow type as nested lists: each level's fixed size (None: it varies), and the leaf's dtype."""

    sizes: tuple[int | None, ...]
    leaf: np.dtype[Any] | None  # None: not a number


def _plain(pa: Any, t: Any) -> Any:
    """The type that holds the values: an extension type's storage, a dictionary's values."""
    while True:
        if isinstance(t, pa.ExtensionType):
            t = t.storage_type
        elif pa.types.is_dictionary(t):
            t = t.value_type
        else:
            return t


def _levels(pa: Any, t: Any) -> _Levels:
    sizes: list[int | None] = []
    t = _plain(pa, t)
    while True:
        if pa.types.is_fixed_size_list(t):
            sizes.append(int(t.list_size))
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            sizes.append(None)
        else:
            break
        t = _plain(pa, t.value_type)
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    return _Levels(tuple(sizes), np.dtype(t.to_pandas_dtype()) if numeric else None)


def hf_features(schema: Any) -> dict[str, Any]:
    """The `datasets` features that a schema's metadata carries (empty where it has none)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(raw)["info"]["features"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}  # a foreign or damaged note: the Arrow types alone still describe the columns
    return features if isinstance(features, dict) else {}


def _field(pa: Any, name: str, t: Any, feature: Any) -> FieldInfo:
    levels = _levels(pa, t)
    dtype = None if levels.leaf is None else levels.leaf.str
    shape: tuple[int, ...] | None = None
    if all(size is not None for size in levels.sizes):
        shape = tuple(int(size) for size in levels.sizes if size is not None)
    if isinstance(feature, Mapping) and feature.get("_type") in _HF_ARRAYS:
        static = feature.get("shape")
        if (
            isinstance(static, list)
            and len(static) == len(levels.sizes)
            and all(isinstance(n, int) for n in static)
        ):
            shape = tuple(static)
    return FieldInfo(name, shape if dtype is not None else None, dtype)


def fields_of_schema(pa: Any, schema: Any) -> tuple[FieldInfo, ...]:
    features = hf_features(schema)
    return tuple(_field(pa, f.name, f.type, features.get(f.name)) for f in schema)


def same_fields(schema: Any, other: Any) -> str | None:
    """The first column on which two schemas disagree, said as a phrase; None where they agree (their
    metadata aside)."""
    mine = {f.name: f.type for f in schema}
    theirs = {f.name: f.type for f in other}
    for name, t in mine.items():
        if name not in theirs:
            return f"column {name!r} ({t}) is missing from the second"
        if theirs[name] != t:
            return f"column {name!r} is {t} in the first and {theirs[name]} in the second"
    extra = [name for name in theirs if name not in mine]
    if extra:
        return f"column {extra[0]!r} ({theirs[extra[0]]}) is missing from the first"
    if list(mine) != list(theirs):
        return f"their columns are in another order ({', '.join(mine)} against {', '.join(theirs)})"
    return None


def _values(pa: Any, arr: Any) -> Any:
    while True:
        if isinstance(arr, pa.ExtensionArray):
            arr = arr.storage
        elif pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        else:
            return arr


def _leaf_numpy(pa: Any, arr: Any, depth: int, name: str) -> np.ndarray:
    """The numbers under `depth` list levels of `arr`, in row order (no row may be missing)."""
    for _ in range(depth):
        if arr.null_count:
            raise ValueError(f"column {name!r} has {arr.null_count} missing (null) rows or elements")
        arr = _values(pa, arr.flatten())
    if arr.null_count:
        raise ValueError(f"column {name!r} has {arr.null_count} missing (null) values; fill them")
    return np.asarray(arr.to_numpy(zero_copy_only=False))


def _column(pa: Any, field: FieldInfo, arr: Any) -> Column:
    arr = _values(pa, arr)
    levels = _levels(pa, arr.type)
    if field.dtype is None or levels.leaf is None:
        return ObjectColumn(arr.to_pylist(), int(arr.nbytes))
    rows = len(arr)
    if field.shape is not None:
        flat = _leaf_numpy(pa, arr, len(levels.sizes), field.name)
        if flat.size != rows * int(np.prod(field.shape, dtype=np.int64)):
            raise ValueError(
                f"column {field.name!r}: {rows} rows hold {flat.size} values, not {rows} of shape "
                f"{field.shape}"
            )
        return FixedColumn(flat.reshape(rows, *field.shape))
    if levels.sizes and levels.sizes[0] is None and all(s is not None for s in levels.sizes[1:]):
        if arr.null_count:
            raise ValueError(f"column {field.name!r} has {arr.null_count} missing (null) rows")
        inner = tuple(int(s) for s in levels.sizes[1:] if s is not None)
        values = _leaf_numpy(pa, arr, len(levels.sizes), field.name).reshape(-1, *inner)
        offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
        return RaggedColumn(values, offsets - offsets[0])
    # Lists of lists of varying sizes: each row as an array where it is rectangular, else as it came.
    out: list[Any] = []
    for value in arr.to_pylist():
        try:
            out.append(np.asarray(value, dtype=levels.leaf))
        except (ValueError, TypeError):
            out.append(value)
    return ObjectColumn(out, int(arr.nbytes))


def decode(pa: Any, table: Any, fields: tuple[FieldInfo, ...], where: str) -> DecodedBlock:
    """A block's columns (a Table or a RecordBatch) as numpy, by field; errors name `where`."""
    columns: dict[str, Column] = {}
    for field in fields:
        try:
            arr = table.column(field.name)
            if isinstance(arr, pa.ChunkedArray):
                arr = arr.combine_chunks()
            columns[field.name] = _column(pa, field, arr)
        except KeyError as exc:
            raise ValueError(f"{where} has no column {field.name!r} any more: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    return DecodedBlock(columns)
