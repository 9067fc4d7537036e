"""Reading the training data: inspection by headers, partitions, loading, and every bad-dataset error."""

from __future__ import annotations

import itertools
import zipfile
from pathlib import Path

import numpy as np
import pytest

from prefect_elastic.dataset import (
    DatasetInfo,
    digits_dataset,
    inspect_dataset,
    load_partition,
    partition_bounds,
    write_npz,
)
from prefect_elastic.errors import JobConfigError


def _arrays(n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(start * 6, (start + n) * 6, dtype=np.float32).reshape(n, 1, 2, 3)
    y = np.arange(start, start + n, dtype=np.int64)
    return x, y


def _sharded(tmp_path: Path, sizes: list[int]) -> tuple[str, np.ndarray, np.ndarray]:
    xs, ys, start = [], [], 0
    for i, n in enumerate(sizes):
        x, y = _arrays(n, start)
        write_npz(str(tmp_path / f"part-{i:03d}.npz"), x, y)
        xs.append(x)
        ys.append(y)
        start += n
    return str(tmp_path), np.concatenate(xs), np.concatenate(ys)


def _config_error(url: str, *words: str) -> JobConfigError:
    with pytest.raises(JobConfigError) as caught:
        inspect_dataset(url)
    err = caught.value
    assert err.field == "dataset"
    assert err.value == url
    message = str(err)
    assert message.startswith(f"dataset={url!r}: ")
    for word in words:
        assert word in message, message
    return err


def test_inspect_single_file(tmp_path: Path) -> None:
    x, y = _arrays(10)
    path = tmp_path / "train.npz"
    write_npz(str(path), x, y)
    info = inspect_dataset(str(path))
    assert info.url == str(path)
    assert len(info.files) == 1 and info.files[0].endswith("train.npz")
    assert info.counts == (10,)
    assert info.total == 10
    assert info.x_shape == (1, 2, 3) and np.dtype(info.x_dtype) == np.float32
    assert info.y_shape == () and np.dtype(info.y_dtype) == np.int64


def test_inspect_sharded_directory_sorted(tmp_path: Path) -> None:
    url, _, _ = _sharded(tmp_path, [4, 3, 5])
    (tmp_path / "README.txt").write_text("not a shard")
    info = inspect_dataset("file://" + url)
    assert [Path(f).name for f in info.files] == ["part-000.npz", "part-001.npz", "part-002.npz"]
    assert info.counts == (4, 3, 5)
    assert info.total == 12


def test_inspect_reads_compressed_npz(tmp_path: Path) -> None:
    x, y = _arrays(7)
    path = tmp_path / "c.npz"
    np.savez_compressed(path, x=x, y=y)
    assert inspect_dataset(str(path)).total == 7


def test_inspect_memory_filesystem() -> None:
    x, y = _arrays(5)
    write_npz("memory://prefect-elastic-test/ds/a.npz", x, y)
    info = inspect_dataset("memory://prefect-elastic-test/ds")
    assert info.total == 5
    got_x, got_y = load_partition(info, 1, 4)
    np.testing.assert_array_equal(got_x, x[1:4])
    np.testing.assert_array_equal(got_y, y[1:4])


@pytest.mark.parametrize(
    ("start", "stop"), [(0, 12), (0, 4), (2, 9), (4, 7), (3, 4), (11, 12), (6, 6), (0, 0), (12, 12)]
)
def test_load_partition_across_shards(tmp_path: Path, start: int, stop: int) -> None:
    url, x, y = _sharded(tmp_path, [4, 3, 5])
    info = inspect_dataset(url)
    got_x, got_y = load_partition(info, start, stop)
    np.testing.assert_array_equal(got_x, x[start:stop])
    np.testing.assert_array_equal(got_y, y[start:stop])
    assert got_x.dtype == x.dtype and got_y.dtype == y.dtype
    assert got_x.shape == (stop - start, 1, 2, 3)


def test_load_partition_reads_only_overlapping_files(tmp_path: Path) -> None:
    url, x, _ = _sharded(tmp_path, [4, 3, 5])
    info = inspect_dataset(url)
    # A broken file outside the range must not be read.
    (tmp_path / "part-002.npz").write_bytes(b"garbage")
    got_x, _ = load_partition(info, 0, 7)
    np.testing.assert_array_equal(got_x, x[:7])


@pytest.mark.parametrize("layout", ["compressed", "fortran"])
def test_load_partition_reads_rows_of_any_npz(tmp_path: Path, layout: str) -> None:
    # Rows are read by seeking inside the .npy member; a compressed member and a column-major array take
    # the other paths and must give the same rows.
    x, y = _arrays(10)
    if layout == "fortran":
        x = np.asfortranarray(x)
    save = np.savez_compressed if layout == "compressed" else np.savez
    save(tmp_path / "one.npz", x=x, y=y)
    info = inspect_dataset(str(tmp_path / "one.npz"))
    got_x, got_y = load_partition(info, 3, 8)
    np.testing.assert_array_equal(got_x, x[3:8])
    np.testing.assert_array_equal(got_y, y[3:8])


def test_load_partition_out_of_range(tmp_path: Path) -> None:
    url, _, _ = _sharded(tmp_path, [4])
    info = inspect_dataset(url)
    with pytest.raises(ValueError, match="outside"):
        load_partition(info, 2, 5)
    with pytest.raises(ValueError, match="outside"):
        load_partition(info, 3, 2)


def test_load_partition_file_changed(tmp_path: Path) -> None:
    url, _, _ = _sharded(tmp_path, [4, 3])
    info = inspect_dataset(url)
    x, y = _arrays(9)
    write_npz(str(tmp_path / "part-001.npz"), x, y)
    with pytest.raises(JobConfigError) as caught:
        load_partition(info, 0, 7)
    assert caught.value.field == "dataset"
    assert "part-001.npz" in str(caught.value)
    assert "9" in str(caught.value) and "3" in str(caught.value)


def test_load_partition_file_vanished(tmp_path: Path) -> None:
    url, _, _ = _sharded(tmp_path, [4, 3])
    info = inspect_dataset(url)
    (tmp_path / "part-000.npz").unlink()
    with pytest.raises(JobConfigError, match=r"part-000\.npz"):
        load_partition(info, 0, 2)


def test_partitions_cover_range_contiguously() -> None:
    for total in (0, 1, 7, 10, 1797):
        for parts in (1, 2, 3, 4, 7):
            bounds = [partition_bounds(total, parts, i) for i in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1
            # The first total % parts partitions are the larger ones.
            assert sizes == sorted(sizes, reverse=True)


def test_partition_bounds_examples_and_errors() -> None:
    assert [partition_bounds(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError):
        partition_bounds(10, 0, 0)
    with pytest.raises(ValueError):
        partition_bounds(10, 3, 3)
    with pytest.raises(ValueError):
        partition_bounds(-1, 3, 0)


def test_nonexistent_path(tmp_path: Path) -> None:
    url = str(tmp_path / "nope.npz")
    _config_error(url, "does not exist")


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no shards here")
    _config_error(str(tmp_path), "directory without .npz files")


def test_corrupt_file_named(tmp_path: Path) -> None:
    url, _, _ = _sharded(tmp_path, [3])
    (tmp_path / "part-001.npz").write_bytes(b"this is not a zip file at all" * 10)
    _config_error(url, "part-001.npz", "not a valid .npz")


def test_truncated_file(tmp_path: Path) -> None:
    x, y = _arrays(50)
    path = tmp_path / "t.npz"
    write_npz(str(path), x, y)
    path.write_bytes(path.read_bytes()[:200])
    _config_error(str(path), "t.npz", "not a valid .npz")


def test_zip_with_garbled_npy(tmp_path: Path) -> None:
    path = tmp_path / "g.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", b"not an npy header")
        archive.writestr("y.npy", b"not an npy header")
    _config_error(str(path), "g.npz", "not a valid .npz")


def test_missing_y(tmp_path: Path) -> None:
    x, _ = _arrays(3)
    path = tmp_path / "noy.npz"
    np.savez(path, x=x, labels=np.zeros(3))
    err = _config_error(str(path), "noy.npz", "'y'", "labels", "x")
    assert "'x'" not in err.problem.split("(it has")[0]


def test_missing_x(tmp_path: Path) -> None:
    path = tmp_path / "nox.npz"
    np.savez(path, inputs=np.zeros((3, 2)), y=np.zeros(3))
    _config_error(str(path), "nox.npz", "'x'", "inputs")


def test_length_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "mismatch.npz"
    write_npz(str(path), np.zeros((5, 2), dtype=np.float32), np.zeros(4, dtype=np.int64))
    _config_error(str(path), "mismatch.npz", "5", "4")


def test_scalar_array_refused(tmp_path: Path) -> None:
    path = tmp_path / "scalar.npz"
    write_npz(str(path), np.zeros((3, 2)), np.array(1))
    _config_error(str(path), "scalar.npz", "scalar")


def test_shards_disagree_on_shape(tmp_path: Path) -> None:
    write_npz(str(tmp_path / "a.npz"), np.zeros((3, 2), dtype=np.float32), np.zeros(3, dtype=np.int64))
    write_npz(str(tmp_path / "b.npz"), np.zeros((3, 5), dtype=np.float32), np.zeros(3, dtype=np.int64))
    _config_error(str(tmp_path), "a.npz", "b.npz", "(2,)", "(5,)")


def test_shards_disagree_on_dtype(tmp_path: Path) -> None:
    write_npz(str(tmp_path / "a.npz"), np.zeros((3, 2), dtype=np.float32), np.zeros(3, dtype=np.int64))
    write_npz(str(tmp_path / "b.npz"), np.zeros((3, 2), dtype=np.float32), np.zeros(3, dtype=np.int32))
    _config_error(str(tmp_path), "'y'", "int64", "int32")


def test_empty_dataset(tmp_path: Path) -> None:
    write_npz(str(tmp_path / "a.npz"), np.zeros((0, 2), dtype=np.float32), np.zeros(0, dtype=np.int64))
    _config_error(str(tmp_path), "0 samples")


def test_digits_single_file(tmp_path: Path) -> None:
    url = digits_dataset(str(tmp_path / "digits"))
    assert url == "file://" + str((tmp_path / "digits" / "digits.npz").resolve())
    info = inspect_dataset(url)
    assert info.total == 1797
    assert info.x_shape == (1, 8, 8) and np.dtype(info.x_dtype) == np.float32
    assert info.y_shape == () and np.dtype(info.y_dtype) == np.int64
    x, y = load_partition(info, 0, info.total)
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert set(np.unique(y)) == set(range(10))


def test_digits_sharded_equals_single(tmp_path: Path) -> None:
    one = inspect_dataset(digits_dataset(str(tmp_path / "one")))
    url = digits_dataset(str(tmp_path / "many"), shards=4)
    assert url == "file://" + str((tmp_path / "many").resolve())
    many = inspect_dataset(url)
    assert [Path(f).name for f in many.files] == [f"digits-{i:03d}.npz" for i in range(4)]
    assert many.total == 1797
    x1, y1 = load_partition(one, 100, 1500)
    x4, y4 = load_partition(many, 100, 1500)
    np.testing.assert_array_equal(x1, x4)
    np.testing.assert_array_equal(y1, y4)


def test_dataset_info_total() -> None:
    info = DatasetInfo(
        url="u", files=("a", "b"), counts=(2, 3), x_shape=(1,), x_dtype="<f4", y_shape=(), y_dtype="<i8"
    )
    assert info.total == 5
