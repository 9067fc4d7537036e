"""Parquet files as a source: one file, a folder of them or a glob, in sorted order, one schema for all.

Inspecting reads each file's footer only (its schema and row groups: a few small reads on an object store).
A block is a row group: `ParquetFile.read_row_group` reads the one asked for, only the source's columns,
through an fsspec file opened with the job's storage options; each process keeps its files open (their
footers parsed once) and opens them again lazily after `close`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..dataset import explain_storage_error, is_object_store, open_for_ranges
from .arrow_columns import decode, fields_of_schema, require_pyarrow, same_fields
from .columns import ColumnarSource, DecodedBlock
from .source_info import SourceInfo, refusal

__all__ = ["ParquetSource", "inspect_parquet"]


def _pandas_index(name: str) -> bool:
    """A column pandas' `to_parquet` adds for a DataFrame's index: not a field of the samples."""
    return name.startswith("__index_level_") and name.endswith("__")


def _footer(pa: Any, fs: Any, path: str) -> Any:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as raw:
        return pq.ParquetFile(raw).metadata


def inspect_parquet(
    setting: str, value: str, fs: Any, paths: list[str], storage_options: Mapping[str, Any]
) -> SourceInfo:
    """The Parquet files at `paths` (sorted, on `fs`) described by their footers."""
    pa = require_pyarrow(setting, value, "Parquet")
    files: list[str] = []
    groups: list[int] = []
    blocks: list[int] = []
    first_schema: Any = None
    first_file = ""
    for path in paths:
        shown = fs.unstrip_protocol(path)
        try:
            meta = _footer(pa, fs, path)
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, ValueError, EOFError) as exc:
            raise refusal(
                setting,
                value,
                f"{shown} is not a Parquet file that reads ({type(exc).__name__}: {exc}); rewrite it "
                "(e.g. pyarrow.parquet.write_table) or remove it from the dataset",
            ) from exc
        except Exception as exc:  # the storage's own failures: a network, credential or server error
            problem = explain_storage_error(exc, storage_options)
            raise refusal(setting, value, f"{shown} cannot be read: {problem}") from exc
        if first_schema is None:
            first_schema, first_file = schema, shown
        else:
            disagree = same_fields(first_schema, schema)
            if disagree is not None:
                raise refusal(
                    setting,
                    value,
                    f"the files' schemas disagree: {first_file} and {shown}: {disagree}; write every file "
                    "with the same columns and types",
                )
        files.append(shown)
        groups.append(meta.num_row_groups)
        blocks.extend(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
    fields = tuple(f for f in fields_of_schema(pa, first_schema) if not _pandas_index(f.name))
    if not fields:
        raise refusal(setting, value, f"{first_file} has no columns; there is nothing to train on")
    if sum(blocks) == 0:
        raise refusal(setting, value, f"holds 0 rows in {len(files)} file(s); there is nothing to train on")
    return SourceInfo(
        setting=setting,
        url=value,
        kind="parquet",
        length=sum(blocks),
        fields=fields,
        tuple_items=False,
        blocks=tuple(blocks),
        object_store=is_object_store(fs),
        storage_options=dict(storage_options),
        detail=(tuple(files), tuple(groups)),
    )


class ParquetSource(ColumnarSource):
    """Reads Parquet row groups on demand (`SourceInfo.detail`: the files' URLs and their row groups)."""

    def __init__(self, info: SourceInfo, cache_bytes: int) -> None:
        super().__init__(info, cache_bytes)
        self.pa = require_pyarrow(info.setting, info.url, "Parquet")
        files, groups = info.detail
        self.files: tuple[str, ...] = files
        # Block b is row group `where[b][1]` of file `where[b][0]`.
        self.where = [(i, g) for i, count in enumerate(groups) for g in range(count)]
        self.open_files: dict[int, tuple[Any, Any]] = {}  # file index: (fsspec file, ParquetFile)

    def parquet_file(self, index: int) -> Any:
        opened = self.open_files.get(index)
        if opened is None:
            import pyarrow.parquet as pq

            url = self.files[index]
            try:
                raw = open_for_ranges(url, self.info.storage_options)
            except Exception as exc:
                problem = explain_storage_error(exc, self.info.storage_options)
                raise OSError(f"{url} cannot be opened: {problem}") from exc
            try:
                opened = (raw, pq.ParquetFile(raw))
            except Exception:
                raw.close()
                raise
            self.open_files[index] = opened
        return opened[1]

    def load(self, block: int) -> DecodedBlock:
        index, group = self.where[block]
        where = f"{self.files[index]} (row group {group})"
        try:
            table = self.parquet_file(index).read_row_group(group, columns=list(self.names))
        except (self.pa.ArrowException, ValueError, OSError) as exc:
            raise ValueError(f"{where} could not be read ({type(exc).__name__}: {exc})") from exc
        return decode(self.pa, table, self.info.fields, where)

    def close_files(self) -> None:
        opened, self.open_files = self.open_files, {}
        for raw, _ in opened.values():
            raw.close()
