"""Every source that cannot be trained on is refused before any cluster work, with a `JobConfigError` whose
`field` is the setting and whose message names what is wrong (the file, the column, the type) and what to
do; and what only a read can find (a missing value) names its column and file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefect_elastic.data.sources import inspect_source, is_factory_path, open_source
from prefect_elastic.errors import JobConfigError

SETTING = "eval_dataset"  # not "dataset": every error names the setting it came from


def refused(value: str, *said: str) -> JobConfigError:
    with pytest.raises(JobConfigError) as caught:
        inspect_source(SETTING, value)
    error = caught.value
    assert error.field == SETTING and error.value == value
    for text in said:
        assert text in str(error), (text, str(error))
    return error


def test_a_factory_path_is_told_from_a_url() -> None:
    assert is_factory_path("tests.sources_factories:pairs")
    assert is_factory_path("pkg.mod:Class.build")
    for url in ("s3://bucket/train:v1", "/data/train.parquet", "train", "C:/data", "mod:"):
        assert not is_factory_path(url), url


def test_a_missing_path_is_refused_with_the_kinds_there_are(tmp_path: Path) -> None:
    refused(str(tmp_path / "nowhere"), "does not exist", ".parquet", "save_to_disk", "module:factory")
    refused(f"{tmp_path}/*.parquet", "matches no file")
    refused("", "must be a URL or an import path")


def test_a_folder_of_nothing_trainable_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    refused(str(tmp_path), "without .npz or .parquet files", "notes.txt")
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    refused(str(tmp_path / "data.csv"), "neither a .npz nor a Parquet file")


def test_a_corrupt_parquet_file_is_named(tmp_path: Path) -> None:
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"PAR1 this is not really parquet")
    refused(str(tmp_path), f"{tmp_path}/b.parquet is not a Parquet file that reads")


def test_parquet_files_whose_schemas_disagree_are_named_with_the_column(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([1.0], pa.float32()), "y": [1]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([1.0], pa.float64()), "y": [1]}), tmp_path / "b.parquet")
    refused(str(tmp_path), "a.parquet and", "b.parquet", "column 'x' is float in the first and double")
    pq.write_table(pa.table({"x": pa.array([1.0], pa.float32())}), tmp_path / "b.parquet")
    refused(str(tmp_path), "b.parquet", "column 'y' (int64) is missing from the second")


def test_an_empty_parquet_dataset_is_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([], pa.float32())}), tmp_path / "a.parquet")
    refused(str(tmp_path / "a.parquet"), "holds 0 rows", "nothing to train on")


def test_a_missing_value_is_named_by_its_column_and_file_when_read(tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": pa.array([1.0, None, 3.0], pa.float32())}), tmp_path / "a.parquet")
    source = open_source(inspect_source(SETTING, str(tmp_path / "a.parquet")))
    with pytest.raises(ValueError, match=r"a\.parquet \(row group 0\).*column 'x' has 1 missing"):
        source.items([0])


def test_without_pyarrow_the_extra_to_install_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pq.write_table(pa.table({"x": [1]}), tmp_path / "a.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    refused(str(tmp_path / "a.parquet"), "pyarrow is not installed", "pip install 'prefect-elastic[data]'")


def test_a_dataset_dict_folder_is_refused_with_its_splits(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    refused(str(tmp_path), "is a DatasetDict folder (splits: train, test)", f"{tmp_path}/train")


def test_a_datasets_folder_whose_data_does_not_read_is_named(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    refused(str(tmp_path), "lists data-00000-of-00001.arrow, which is not in the folder")
    (tmp_path / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff\x10\x00\x00\x00garbage")
    refused(str(tmp_path), "data-00000-of-00001.arrow is not an Arrow stream that reads")


def test_datasets_files_whose_schemas_disagree_are_named(tmp_path: Path) -> None:
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, column in zip(names, [pa.array([1]), pa.array(["one"])], strict=True):
        data = pa.table({"label": column})
        with pa.OSFile(str(tmp_path / name), "wb") as sink, pa.ipc.new_stream(sink, data.schema) as writer:
            writer.write_table(data)
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    refused(str(tmp_path), names[0], names[1], "column 'label' is int64 in the first and string")


@pytest.mark.parametrize(
    ("factory", "said"),
    [
        ("tests.no_such_module:build", ["module 'tests.no_such_module' was not found"]),
        ("tests.sources_factories:nothing", ["has no attribute 'nothing'"]),
        ("tests.sources_factories:raises", ["the factory raised FileNotFoundError", "/data/images"]),
        ("tests.sources_factories:a_number", ["returned a int, not a Dataset"]),
        ("tests.sources_factories:stream", ["IterableDataset (Stream)", "map-style"]),
        ("tests.sources_factories:no_length", ["NoLength has no __len__"]),
        ("tests.sources_factories:empty", ["Empty is empty"]),
        ("tests.sources_factories:lone", ["item 0 of the Lone is a Tensor", "tuples", "dicts"]),
        ("tests.sources_factories:broken", ["reading item 0 of the Broken raised RuntimeError", "truncated"]),
    ],
)
def test_a_factory_that_does_not_give_a_dataset_of_samples_is_refused(factory: str, said: list[str]) -> None:
    refused(factory, *said)


def test_an_npz_error_names_this_setting(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", inputs=np.zeros(3), y=np.zeros(3))
    refused(str(tmp_path / "a.npz"), "has no array 'x'")
