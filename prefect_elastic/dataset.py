"""Reading the training data from an fsspec URL.

This module owns the on-storage format of a dataset (one `.npz` file, or a directory of `.npz` shards,
each with arrays `x` and `y` whose first axis is the sample), the cheap up-front inspection of it, the split
of the global sample range into data-server partitions, and loading one partition. The global sample index
runs over the shards in sorted file order, so every data server sees the same numbering.

The URL may be of any fsspec filesystem (a local path, `file://`, `s3://`, `gs://`, ...). The keyword
arguments its filesystem needs (an S3 endpoint, credentials) are given to `inspect_dataset` and travel in
`DatasetInfo.storage_options` to every data server that loads a partition. `explain_storage_error` turns a
failed call to a storage server into a sentence that says what to check; the checkpoints use it too.
"""

from __future__ import annotations

import os
import posixpath
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from numpy.lib import format as npy_format

from prefect_elastic.errors import JobConfigError

__all__ = [
    "DatasetInfo",
    "digits_dataset",
    "explain_storage_error",
    "inspect_dataset",
    "is_object_store",
    "load_partition",
    "missing_bucket",
    "partition_bounds",
    "write_npz",
]

_ARRAYS = ("x", "y")
_READ_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class DatasetInfo:
    """What `inspect_dataset` learned from the npy headers, without reading the arrays."""

    url: str
    files: tuple[str, ...]
    counts: tuple[int, ...]
    x_shape: tuple[int, ...]
    x_dtype: str
    y_shape: tuple[int, ...]
    y_dtype: str
    # fsspec keyword arguments for opening `files` (e.g. an S3 endpoint): every data server needs them.
    storage_options: dict[str, Any] = field(default_factory=dict, hash=False, repr=False)

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class _Header:
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fortran: bool = False
    data_start: int = 0  # offset of the first byte of data in the .npy member


def _fail(url: str, problem: str) -> JobConfigError:
    return JobConfigError(field="dataset", value=url, problem=problem)


def explain_storage_error(exc: BaseException, storage_options: Mapping[str, Any]) -> str:
    """A failed call to a storage server, said so that a user knows what to check.

    A server that cannot be reached (wrong endpoint, server down) and credentials that are refused get
    their own advice; anything else is shown as it came.
    """
    endpoint = _endpoint(storage_options)
    at = f" at {endpoint}" if endpoint else ""
    text = f"{type(exc).__name__}: {exc}"
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionError"}:
        given = f"the endpoint_url {endpoint!r} in storage_options" if endpoint else "the storage server"
        return f"the storage server{at} cannot be reached ({text}); check {given} and that it is up"
    if names & {"NoCredentialsError", "PartialCredentialsError"} or isinstance(exc, PermissionError):
        if "Credentials" in type(exc).__name__:
            problem = f"this process has no credentials for the storage server{at}"
        else:
            problem = f"the storage server{at} refused access"
        return (
            f"{problem} ({text}); give credentials that may read and write there (in the environment of "
            "every process, e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or as 'key' and 'secret' in "
            "storage_options)"
        )
    return text


def _endpoint(storage_options: Mapping[str, Any]) -> str | None:
    """The S3-style endpoint named in fsspec options, flat or under client_kwargs (s3fs takes both)."""
    client = storage_options.get("client_kwargs")
    for source in (storage_options, client if isinstance(client, Mapping) else {}):
        value = source.get("endpoint_url")
        if value:
            return str(value)
    return None


# fsspec protocols of object stores: flat keys in buckets, no directories, no rename (a move is a copy).
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss"})


def open_for_ranges(url: str, storage_options: Mapping[str, Any]) -> Any:
    """`url` opened to be read by byte ranges (a Parquet row group's column chunks, an Arrow record batch)
    and kept open while a source reads it: with no cache of the filesystem's own, each read one request.
    s3fs's default read-ahead cache holds up to 50 MiB per open file, so a data server holding its
    partition's sixteen files open held some 800 MiB that no `data_cache_bytes` counted, and a static
    worker under a 1 GiB memory limit was restarted by its nanny (benchmarks/data.py, "s3")."""
    fs, path = url_to_fs(url, **storage_options)
    if is_object_store(fs):
        return fs.open(path, "rb", cache_type="none")
    return fs.open(path, "rb")


def is_object_store(fs: Any) -> bool:
    """Whether `fs` is an object store (S3, GCS, Azure, ...), whose "folders" are only key prefixes."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    return bool(protocols & _OBJECT_STORES)


def missing_bucket(fs: Any, path: str) -> str | None:
    """The bucket of `path` on an object store when that bucket does not exist; None otherwise."""
    if not is_object_store(fs) or "/" not in path.strip("/"):
        return None  # not an object store, or the bucket itself (which `exists` already answered)
    bucket = path.strip("/").split("/", 1)[0]
    try:
        return None if fs.exists(bucket) else bucket
    except Exception:
        return None  # no answer about the bucket: say what we know, that the path does not exist


def _read_header(member: IO[bytes]) -> _Header:
    version = npy_format.read_magic(member)
    if version == (1, 0):
        shape, fortran, dtype = npy_format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, fortran, dtype = npy_format.read_array_header_2_0(member)
    else:
        # Version 3.0 only differs by a utf-8 header, which numpy writes just for exotic structured dtypes
        # that a training sample never has; refusing it keeps us off numpy's private reader.
        raise ValueError(f"npy format version {version[0]}.{version[1]} is not supported")
    return _Header(tuple(int(n) for n in shape), np.dtype(dtype), bool(fortran), member.tell())


def _read_headers(fs: Any, path: str, url: str, shown: str) -> dict[str, _Header]:
    """The headers of `x` and `y` in one npz, read through a seekable fsspec file."""
    try:
        with fs.open(path, "rb") as raw, zipfile.ZipFile(raw) as archive:
            names = {name.removesuffix(".npy"): name for name in archive.namelist() if name.endswith(".npy")}
            missing = [key for key in _ARRAYS if key not in names]
            if missing:
                have = ", ".join(sorted(names)) or "no arrays at all"
                raise _fail(
                    url,
                    f"{shown} has no array {' and no array '.join(repr(m) for m in missing)} "
                    f"(it has: {have}); "
                    "every .npz must hold the samples as 'x' and the targets as 'y', e.g. "
                    "numpy.savez(f, x=inputs, y=targets)",
                )
            headers: dict[str, _Header] = {}
            for key in _ARRAYS:
                with archive.open(names[key]) as member:
                    headers[key] = _read_header(member)
    except JobConfigError:
        raise
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, SyntaxError) as exc:
        # numpy's header parser raises ValueError for a garbled header; zipfile raises BadZipFile or
        # EOFError for a truncated archive; both mean the same thing to the user.
        raise _fail(
            url,
            f"{shown} is not a valid .npz file ({type(exc).__name__}: {exc}); rewrite it with "
            "numpy.savez(f, x=inputs, y=targets) or remove it from the dataset",
        ) from exc
    for key in _ARRAYS:
        header = headers[key]
        if not header.shape:
            raise _fail(
                url,
                f"{shown}: array {key!r} is a scalar; its first axis must be the sample axis, "
                "so store at least a 1-d array",
            )
        if header.dtype.hasobject:
            raise _fail(
                url,
                f"{shown}: array {key!r} has dtype {header.dtype} (Python objects), which is read only with "
                "pickle; store a numeric array instead",
            )
    if headers["x"].shape[0] != headers["y"].shape[0]:
        raise _fail(
            url,
            f"{shown} has {headers['x'].shape[0]} samples in 'x' but {headers['y'].shape[0]} in 'y'; "
            "both arrays must have one entry per sample along their first axis",
        )
    return headers


def _list_files(fs: Any, path: str, url: str, storage_options: Mapping[str, Any]) -> list[str]:
    try:
        return _find_files(fs, path, url)
    except JobConfigError:
        raise
    except Exception as exc:  # any storage backend's own errors: a network, credential or server failure
        raise _fail(url, f"cannot be listed: {explain_storage_error(exc, storage_options)}") from exc


def _find_files(fs: Any, path: str, url: str) -> list[str]:
    if not fs.exists(path):
        bucket = missing_bucket(fs, path)
        if bucket is not None:
            raise _fail(
                url,
                f"its bucket {bucket!r} does not exist; fix the URL, or create the bucket and put the "
                "dataset there",
            )
        raise _fail(
            url,
            "does not exist; give the URL of a .npz file or of a directory of .npz shards "
            "(e.g. file:///data/train.npz or s3://bucket/train/), reachable from every static worker",
        )
    if not fs.isdir(path):
        return [path]
    shards = sorted(
        entry for entry in fs.ls(path, detail=False) if str(entry).endswith(".npz") and not fs.isdir(entry)
    )
    if not shards:
        raise _fail(
            url,
            "is a directory without .npz files; put the data there as one or more .npz shards, "
            "each with arrays 'x' and 'y'",
        )
    return [str(entry) for entry in shards]


def inspect_dataset(url: str, storage_options: Mapping[str, Any] | None = None) -> DatasetInfo:
    """Check the dataset at `url` by its npy headers alone and describe it.

    Reading only the headers keeps this cheap for a big dataset, so it can run before any cluster work.
    `storage_options` are the fsspec keyword arguments for `url` (`ElasticJob.storage_for` gives them).
    """
    options = dict(storage_options or {})
    try:
        fs, path = url_to_fs(url, **options)
    except (ValueError, ImportError) as exc:
        raise _fail(
            url,
            f"cannot be opened with fsspec ({type(exc).__name__}: {exc}); check the protocol "
            "and that its fsspec backend (e.g. s3fs, gcsfs) is installed",
        ) from exc
    paths = _list_files(fs, path, url, options)

    files: list[str] = []
    counts: list[int] = []
    first: dict[str, _Header] | None = None
    first_name = ""
    for file_path in paths:
        shown = fs.unstrip_protocol(file_path)
        headers = _read_headers(fs, file_path, url, shown)
        if first is None:
            first, first_name = headers, shown
        else:
            for key in _ARRAYS:
                want, got = first[key], headers[key]
                if want.shape[1:] != got.shape[1:] or want.dtype != got.dtype:
                    raise _fail(
                        url,
                        f"shards disagree on {key!r}: {first_name} has samples of shape {want.shape[1:]} "
                        f"and dtype {want.dtype}, {shown} has shape {got.shape[1:]} and dtype {got.dtype}; "
                        "write every shard with the same per-sample shape and dtype",
                    )
        files.append(shown)
        counts.append(headers["x"].shape[0])

    assert first is not None  # _list_files never returns an empty list
    if sum(counts) == 0:
        raise _fail(url, f"holds 0 samples in {len(files)} file(s); there is nothing to train on")
    return DatasetInfo(
        url=url,
        files=tuple(files),
        counts=tuple(counts),
        x_shape=first["x"].shape[1:],
        x_dtype=first["x"].dtype.str,
        y_shape=first["y"].shape[1:],
        y_dtype=first["y"].dtype.str,
        storage_options=options,
    )


def partition_bounds(total: int, parts: int, index: int) -> tuple[int, int]:
    """The `[start, stop)` of partition `index` when `range(total)` is cut into `parts` contiguous pieces.

    The first `total % parts` partitions get one sample more, so sizes differ by at most one.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"index must be in [0, {parts}), got {index}")
    if total < 0:
        raise ValueError(f"total must not be negative, got {total}")
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    stop = start + size + (1 if index < extra else 0)
    return start, stop


def load_partition(info: DatasetInfo, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """`x` and `y` of the global samples `[start, stop)`, reading only those rows of the files they span.

    The arrays are allocated once at their final size and each file's rows are read straight into them,
    so a data server's memory peaks at its partition, not at the whole file (docs/benchmarks.md).
    """
    if not 0 <= start <= stop <= info.total:
        raise ValueError(f"sample range [{start}, {stop}) is outside the dataset's [0, {info.total})")
    x_out = np.empty((stop - start, *info.x_shape), dtype=np.dtype(info.x_dtype))
    y_out = np.empty((stop - start, *info.y_shape), dtype=np.dtype(info.y_dtype))
    offset = 0
    for file_url, count in zip(info.files, info.counts, strict=True):
        lo, hi = max(start, offset), min(stop, offset + count)
        if lo < hi:
            _read_rows(info, file_url, count, lo - offset, x_out[lo - start : hi - start], "x")
            _read_rows(info, file_url, count, lo - offset, y_out[lo - start : hi - start], "y")
        offset += count
        if offset >= stop:
            break
    return x_out, y_out


def _read_rows(info: DatasetInfo, file_url: str, count: int, first: int, out: np.ndarray, key: str) -> None:
    """Fill `out` with rows `first, first + len(out)` of array `key` of one npz file."""
    expected = info.x_shape if key == "x" else info.y_shape
    try:
        with (
            fsspec.open(file_url, "rb", **info.storage_options) as raw,
            zipfile.ZipFile(raw) as archive,
            archive.open(f"{key}.npy") as member,
        ):
            header = _read_header(member)
            if header.shape[0] != count or header.shape[1:] != expected or header.dtype != out.dtype:
                raise _fail(
                    info.url,
                    f"{file_url} now holds {key!r} of shape {header.shape} and dtype {header.dtype}, but had "
                    f"{count} samples of shape {expected} and dtype {out.dtype} when the dataset was "
                    "inspected; leave the dataset untouched while a job trains on it",
                )
            if header.fortran:
                # Column-major rows are not contiguous in the file: read the whole array (rare).
                member.seek(0)
                out[...] = npy_format.read_array(member, allow_pickle=False)[first : first + len(out)]
                return
            # Seeking a stored (uncompressed) member is a file seek; a compressed one decompresses up to
            # there without keeping what it skips.
            member.seek(header.data_start + first * (out[0:1].nbytes if len(out) else 0))
            view = out.reshape(-1).view(np.uint8).data
            filled = 0
            while filled < len(view):
                # In chunks: a zip member's readinto reads into a temporary bytes of the size asked for.
                n = member.readinto(view[filled : filled + _READ_CHUNK])  # type: ignore[attr-defined]  # a ZipExtFile
                if not n:
                    raise EOFError(f"{key}.npy ends after {filled} of {len(view)} bytes")
                filled += n
    except JobConfigError:
        raise
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
        raise _fail(
            info.url,
            f"{file_url} could not be read any more ({type(exc).__name__}: {exc}); it changed or vanished "
            "after the dataset was inspected; leave the dataset untouched while a job trains on it",
        ) from exc


def write_npz(
    url_or_path: str, x: np.ndarray, y: np.ndarray, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Write one dataset file with arrays `x` and `y` to a path or fsspec URL, creating its directory (on a
    file system: on an object store the bucket must exist). `storage_options` go to its filesystem."""
    fs, path = url_to_fs(url_or_path, **dict(storage_options or {}))
    parent = posixpath.dirname(path)
    if parent and not is_object_store(fs):
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "wb") as out:
        np.savez(out, x=x, y=y)


def digits_dataset(directory: str, shards: int = 1) -> str:
    """Write scikit-learn's 1797 digits into `directory` as `shards` .npz files and return the dataset URL.

    x is float32 of shape (N, 1, 8, 8) in [0, 1], y is int64; one shard is `digits.npz` and the URL names
    that file, more shards are `digits-000.npz`, ... and the URL names the directory.
    """
    from sklearn.datasets import load_digits  # heavy import, needed only by demos and tests

    digits = load_digits()
    x = (np.asarray(digits.data, dtype=np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = np.asarray(digits.target, dtype=np.int64)
    if not 1 <= shards <= len(x):
        raise ValueError(f"shards must be in [1, {len(x)}], got {shards}")

    root = os.path.abspath(directory)
    os.makedirs(root, exist_ok=True)
    if shards == 1:
        target = os.path.join(root, "digits.npz")
        write_npz(target, x, y)
        return "file://" + target
    bounds = [partition_bounds(len(x), shards, i) for i in range(shards)]
    for i, (lo, hi) in enumerate(bounds):
        write_npz(os.path.join(root, f"digits-{i:03d}.npz"), x[lo:hi], y[lo:hi])
    return "file://" + root
