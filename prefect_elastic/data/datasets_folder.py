"""A folder written by Hugging Face `datasets` (`Dataset.save_to_disk`) as a source, read with pyarrow alone.

Such a folder holds `state.json` (its data files in order), `dataset_info.json` (its features) and the data
as Arrow IPC streams `data-XXXXX-of-XXXXX.arrow`. Inspecting reads each stream's message headers (not
their bodies: `arrow_stream.scan_stream`), so the rows of every record batch are known for the price of a
small read per batch; a block is a record batch. Reading a block: from a local file, a slice of the file
memory-mapped (no copy, the page cache holds it); from an object store, one ranged read of that batch's
bytes (random access by batch, no sequential read of the file before it). The `datasets` package itself is
not needed to read (its features come from the schema's metadata), only to write such a folder.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from typing import Any

from ..dataset import explain_storage_error, is_object_store, open_for_ranges
from .arrow_columns import decode, fields_of_schema, require_pyarrow, same_fields
from .arrow_stream import StreamLayout, read_batch, read_schema, scan_stream
from .columns import ColumnarSource, DecodedBlock
from .source_info import SourceInfo, refusal

__all__ = ["DatasetsFolderSource", "inspect_datasets_folder", "splits_of"]

_WHAT = "a Hugging Face datasets folder"


def splits_of(fs: Any, path: str) -> list[str]:
    """The splits a DatasetDict folder's `dataset_dict.json` names (empty where it says none)."""
    try:
        with fs.open(posixpath.join(path, "dataset_dict.json"), "rb") as f:
            splits = json.load(f).get("splits", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [str(s) for s in splits] if isinstance(splits, list) else []


def _data_files(setting: str, value: str, fs: Any, path: str) -> list[str]:
    """The folder's data files in order: as its `state.json` lists them, else by name."""
    present = sorted(
        posixpath.basename(str(p)) for p in fs.ls(path, detail=False) if str(p).endswith(".arrow")
    )
    listed: list[str] = []
    try:
        with fs.open(posixpath.join(path, "state.json"), "rb") as f:
            listed = [str(entry["filename"]) for entry in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        listed = []  # no state.json, or one of another version: the data files' names give the order
    missing = [name for name in listed if name not in present]
    if missing:
        raise refusal(
            setting,
            value,
            f"its state.json lists {missing[0]}, which is not in the folder; save the dataset again "
            "(Dataset.save_to_disk) or copy the whole folder",
        )
    names = listed or [name for name in present if name.startswith("data-")] or present
    if not names:
        raise refusal(
            setting,
            value,
            "is a datasets folder (it has state.json or dataset_info.json) without .arrow data files; "
            "save the dataset again with Dataset.save_to_disk",
        )
    return [posixpath.join(path, name) for name in names]


def _scan(fs: Any, path: str, local: bool) -> tuple[StreamLayout, bytes]:
    # Small blocks on a remote store: each header read fetches a few KB, not the store's default 5+ MB.
    options: dict[str, Any] = {} if local else {"block_size": 2**16, "cache_type": "readahead"}
    with fs.open(path, "rb", **options) as f:
        layout = scan_stream(f)
        f.seek(layout.prefix[0])
        prefix = f.read(layout.prefix[1] - layout.prefix[0])
    return layout, prefix


def inspect_datasets_folder(
    setting: str, value: str, fs: Any, path: str, storage_options: Mapping[str, Any]
) -> SourceInfo:
    """The `datasets` folder at `path` described by its streams' message headers."""
    pa = require_pyarrow(setting, value, _WHAT)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    local = "file" in protocols
    urls: list[str] = []
    paths: list[str] = []
    layouts: list[StreamLayout] = []
    first_schema: Any = None
    first_file = ""
    for file_path in _data_files(setting, value, fs, path):
        shown = fs.unstrip_protocol(file_path)
        try:
            layout, prefix = _scan(fs, file_path, local)
            schema = read_schema(pa, prefix)
        except (pa.ArrowException, ValueError, EOFError) as exc:
            raise refusal(
                setting,
                value,
                f"{shown} is not an Arrow stream that reads ({type(exc).__name__}: {exc}); save the dataset "
                "again with Dataset.save_to_disk",
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
                    f"the data files' schemas disagree: {first_file} and {shown}: {disagree}; save the "
                    "dataset again with Dataset.save_to_disk",
                )
        urls.append(shown)
        paths.append(file_path)
        layouts.append(layout)
    blocks = tuple(rows for layout in layouts for rows in layout.rows)
    fields = fields_of_schema(pa, first_schema)
    if not fields:
        raise refusal(setting, value, f"{first_file} has no columns; there is nothing to train on")
    if sum(blocks) == 0:
        raise refusal(setting, value, f"holds 0 rows in {len(urls)} file(s); there is nothing to train on")
    local_paths = tuple(paths) if local else None
    return SourceInfo(
        setting=setting,
        url=value,
        kind="datasets",
        length=sum(blocks),
        fields=fields,
        tuple_items=False,
        blocks=blocks,
        object_store=is_object_store(fs),
        storage_options=dict(storage_options),
        detail=(tuple(urls), tuple(layouts), local_paths),
    )


class _OpenStream:
    """One data file open in this process: its schema, its prefix, and how a batch's bytes are read."""

    def __init__(self, pa: Any, url: str, local_path: str | None, storage_options: Mapping[str, Any]) -> None:
        self.map: Any = None
        self.raw: Any = None
        if local_path is not None:
            self.map = pa.memory_map(local_path, "r")
            self.whole = self.map.read_buffer()  # zero-copy: slices of it are pages of the file
        else:
            self.raw = open_for_ranges(url, storage_options)

    def read(self, start: int, length: int) -> Any:
        if self.map is not None:
            if start + length > self.whole.size:
                raise EOFError(f"the file has {self.whole.size} bytes, the batch ends at {start + length}")
            return self.whole.slice(start, length)
        self.raw.seek(start)
        data = self.raw.read(length)
        if len(data) != length:
            raise EOFError(f"the file ends after {len(data)} of the batch's {length} bytes")
        return data

    def close(self) -> None:
        for handle in (self.raw, self.map):
            if handle is not None:
                handle.close()


class DatasetsFolderSource(ColumnarSource):
    """Reads a `datasets` folder's record batches on demand (`SourceInfo.detail`: the files' URLs, their
    layouts, and their local paths where the files are local)."""

    def __init__(self, info: SourceInfo, cache_bytes: int) -> None:
        super().__init__(info, cache_bytes)
        self.pa = require_pyarrow(info.setting, info.url, _WHAT)
        self.urls, self.layouts, self.local_paths = info.detail
        self.where = [(i, b) for i, layout in enumerate(self.layouts) for b in range(len(layout.batches))]
        self.streams: dict[int, tuple[_OpenStream, Any, Any]] = {}  # file index: (file, schema, prefix)

    def stream(self, index: int) -> tuple[_OpenStream, Any, Any]:
        opened = self.streams.get(index)
        if opened is None:
            local = None if self.local_paths is None else self.local_paths[index]
            stream = _OpenStream(self.pa, self.urls[index], local, self.info.storage_options)
            try:
                start, stop = self.layouts[index].prefix
                prefix = stream.read(start, stop - start)
                opened = (stream, read_schema(self.pa, prefix), prefix)
            except Exception:
                stream.close()
                raise
            self.streams[index] = opened
        return opened

    def load(self, block: int) -> DecodedBlock:
        index, batch = self.where[block]
        where = f"{self.urls[index]} (record batch {batch})"
        layout: StreamLayout = self.layouts[index]
        try:
            stream, schema, prefix = self.stream(index)
            start, length = layout.batches[batch]
            record_batch = read_batch(self.pa, layout, schema, prefix, stream.read(start, length))
        except (self.pa.ArrowException, ValueError, OSError, EOFError) as exc:
            raise ValueError(f"{where} could not be read ({type(exc).__name__}: {exc})") from exc
        return decode(self.pa, record_batch, self.info.fields, where)

    def close_files(self) -> None:
        opened, self.streams = self.streams, {}
        for stream, _, _ in opened.values():
            stream.close()
