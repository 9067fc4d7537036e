"""Where a job's samples come from: a dataset setting's value told apart by kind, inspected before any
cluster work (`inspect_source`), and opened in each process that reads it (`open_source`).

A value is either the import path `"module:factory"` of a user's Dataset factory, or an fsspec URL (a
local path, `file://`, `s3://`, ...; `storage_options` are the keyword arguments of its filesystem) of:

- `.npz` files with arrays `x` and `y`: one file or a folder of them (`npz_source`);
- Parquet: one file, a folder of `.parquet` files, or a glob (`s3://b/train/*.parquet`), in sorted order,
  all of one schema (`parquet_source`);
- a folder written by Hugging Face `datasets`' `Dataset.save_to_disk` (`datasets_folder`).

Inspecting reads headers and metadata only. Opening is cheap and takes only the `SourceInfo` (picklable),
so a worker that joins opens the source again; a columnar source then reads the blocks that hold the
samples asked for, keeping at most `cache_bytes` of them decoded (`columns.BlockCache`). pyarrow (Parquet,
`datasets` folders) is imported only when such a source is used. Every refusal is a `JobConfigError` that
names the setting.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fsspec.core import url_to_fs

from ..dataset import explain_storage_error, missing_bucket
from ..errors import JobConfigError
from .datasets_folder import DatasetsFolderSource, inspect_datasets_folder, splits_of
from .factory_source import FactorySource, inspect_factory
from .npz_source import NpzSource, inspect_npz
from .parquet_source import ParquetSource, inspect_parquet
from .source_info import FieldInfo, Source, SourceInfo, SourceKind, refusal

__all__ = [
    "FieldInfo",
    "Source",
    "SourceInfo",
    "SourceKind",
    "inspect_source",
    "is_factory_path",
    "only_fields",
    "open_source",
]

_FACTORY = re.compile(r"[A-Za-z_]\w*(\.\w+)*:[A-Za-z_]\w*(\.\w+)*")
_PARQUET = (".parquet", ".parq", ".pq")
_GLOB = re.compile(r"[*?\[]")
_KINDS = (
    "a .npz file or a folder of them (arrays 'x' and 'y'), a .parquet file, a folder of them or a glob, "
    "a folder written by datasets' Dataset.save_to_disk, or the import path 'module:factory' of a function "
    "returning a torch Dataset"
)


def is_factory_path(value: str) -> bool:
    """Whether a setting's value names a Dataset factory (`"module:factory"`) rather than a URL."""
    return "://" not in value and _FACTORY.fullmatch(value) is not None


def inspect_source(setting: str, value: str, storage_options: Mapping[str, Any] | None = None) -> SourceInfo:
    """Check the source that `setting`'s `value` names, from its headers and metadata alone, and describe
    it; a `JobConfigError` naming `setting` where it cannot be trained on."""
    if not isinstance(value, str) or not value.strip():
        raise refusal(setting, value, f"must be a URL or an import path: {_KINDS}")
    if is_factory_path(value):
        return inspect_factory(setting, value)
    options = dict(storage_options or {})
    try:
        fs, path = url_to_fs(value, **options)
    except (ValueError, ImportError) as exc:
        raise refusal(
            setting,
            value,
            f"cannot be opened with fsspec ({type(exc).__name__}: {exc}); check the protocol and that its "
            "fsspec backend (e.g. s3fs, gcsfs) is installed",
        ) from exc
    try:
        kind, paths = _locate(setting, value, fs, path)
    except JobConfigError:
        raise
    except Exception as exc:  # any storage backend's own errors: a network, credential or server failure
        raise refusal(setting, value, f"cannot be listed: {explain_storage_error(exc, options)}") from exc
    if kind == "npz":
        return inspect_npz(setting, value, options)
    if kind == "parquet":
        return inspect_parquet(setting, value, fs, paths, options)
    return inspect_datasets_folder(setting, value, fs, paths[0], options)


def open_source(info: SourceInfo, cache_bytes: int = 256 * 2**20) -> Source:
    """The source `info` describes, opened in this process (cheap: its files open lazily, on first read);
    a columnar one keeps at most `cache_bytes` of decoded blocks."""
    readers = {"npz": NpzSource, "parquet": ParquetSource, "datasets": DatasetsFolderSource}
    if info.kind == "factory":
        return FactorySource(info, cache_bytes)
    return readers[info.kind](info, cache_bytes)


def only_fields(info: SourceInfo, names: Iterable[str]) -> SourceInfo:
    """`info` with only the fields `names` (in the source's order): a columnar source opened with it reads
    only those columns, and gives whole batches (`rows`) where those are all numeric of one shape though
    others (a text column) are not. A factory's items are what its Dataset returns: its info is kept whole."""
    wanted = set(names)
    if info.kind == "factory":
        return info
    missing = sorted(wanted - set(info.names))
    if missing:
        raise refusal(info.setting, info.url, f"has no field {missing[0]!r} (it has {', '.join(info.names)})")
    return dataclasses.replace(info, fields=tuple(f for f in info.fields if f.name in wanted))


def _locate(setting: str, value: str, fs: Any, path: str) -> tuple[SourceKind, list[str]]:
    """The kind of the source at `path` and the paths its inspection reads (a folder's or a glob's
    files; an npz source's and a datasets folder's own path)."""
    if _GLOB.search(path):
        matches = sorted(str(p) for p in fs.glob(path) if not fs.isdir(p))
        if not matches:
            raise refusal(
                setting, value, "matches no file; check the pattern (e.g. s3://bucket/train/*.parquet)"
            )
        if all(p.endswith(".npz") for p in matches):
            raise refusal(setting, value, "is a glob of .npz files; give their folder instead")
        return "parquet", matches
    if not fs.exists(path):
        raise refusal(setting, value, _missing(fs, path))
    if not fs.isdir(path):
        return _kind_of_file(setting, value, fs, path), [path]
    entries = [str(p) for p in fs.ls(path, detail=False)]
    names = {posixpath.basename(p.rstrip("/")) for p in entries}
    if "dataset_dict.json" in names:
        splits = splits_of(fs, path) or sorted(n for n in names if "." not in n)
        example = value.rstrip("/") + "/" + (splits[0] if splits else "train")
        raise refusal(
            setting,
            value,
            f"is a DatasetDict folder (splits: {', '.join(splits) or 'none listed'}); point at one split's "
            f"subfolder instead, e.g. {example!r}",
        )
    if names & {"state.json", "dataset_info.json"}:
        return "datasets", [path]
    parquet = sorted(p for p in entries if p.endswith(_PARQUET) and not fs.isdir(p))
    npz = [p for p in entries if p.endswith(".npz")]
    if parquet and npz:
        raise refusal(
            setting,
            value,
            f"is a folder of both .parquet and .npz files ({len(parquet)} and {len(npz)}); keep one format "
            "in a folder, or give a glob (e.g. .../*.parquet)",
        )
    if parquet:
        return "parquet", parquet
    if npz:
        return "npz", [path]
    shown = ", ".join(sorted(names)[:5]) or "nothing"
    raise refusal(
        setting,
        value,
        f"is a folder without .npz or .parquet files and is not a datasets folder (it has {shown}); "
        f"give {_KINDS}",
    )


def _kind_of_file(setting: str, value: str, fs: Any, path: str) -> SourceKind:
    if path.endswith(".npz"):
        return "npz"
    if path.endswith(_PARQUET):
        return "parquet"
    if path.endswith(".arrow"):
        raise refusal(
            setting,
            value,
            "is one .arrow file; give the folder that Dataset.save_to_disk wrote (with its state.json)",
        )
    with fs.open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1":
        return "parquet"
    if magic == b"PK\x03\x04":
        return "npz"
    raise refusal(
        setting, value, f"is neither a .npz nor a Parquet file (it starts with {magic!r}); give {_KINDS}"
    )


def _missing(fs: Any, path: str) -> str:
    """What to say of a path that does not exist: its bucket where that is what is missing."""
    bucket = missing_bucket(fs, path)
    if bucket is not None:
        return (
            f"its bucket {bucket!r} does not exist; fix the URL, or create the bucket and put the dataset "
            "there"
        )
    return f"does not exist; give the URL, reachable from every static worker, of {_KINDS}"
