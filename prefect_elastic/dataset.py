"""Reading the training data from an fsspec URL.

This module owns the on-storage format of a dataset (one `.npz` file, or a directory of `.npz` shards,
each with arrays `x` and `y` whose first axis is the sample), the cheap up-front inspection of it, the split
of the global sample range into data-server partitions, and loading one partition. The global sample index
runs over the shards in sorted file order, so every data server sees the same numbering.
"""

from __future__ import annotations

import os
import posixpath
import zipfile
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from numpy.lib import format as npy_format

from prefect_elastic.errors import JobConfigError

__all__ = [
    "DatasetInfo",
    "digits_dataset",
    "inspect_dataset",
    "load_partition",
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


def _list_files(fs: Any, path: str, url: str) -> list[str]:
    if not fs.exists(path):
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


def inspect_dataset(url: str) -> DatasetInfo:
    """Check the dataset at `url` by its npy headers alone and describe it.

    Reading only the headers keeps this cheap for a big dataset, so it can run before any cluster work.
    """
    try:
        fs, path = url_to_fs(url)
    except (ValueError, ImportError) as exc:
        raise _fail(
            url,
            f"cannot be opened with fsspec ({type(exc).__name__}: {exc}); check the protocol "
            "and that its fsspec backend (e.g. s3fs, gcsfs) is installed",
        ) from exc
    paths = _list_files(fs, path, url)

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
            fsspec.open(file_url, "rb") as raw,
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


def write_npz(url_or_path: str, x: np.ndarray, y: np.ndarray) -> None:
    """Write one dataset file with arrays `x` and `y` to a path or fsspec URL, creating its directory."""
    fs, path = url_to_fs(url_or_path)
    parent = posixpath.dirname(path)
    if parent:
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
