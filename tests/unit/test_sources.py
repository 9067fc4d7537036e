"""The data sources (`prefect_elastic.data.sources`), each kind inspected and read in this process: `.npz`,
Parquet (one file, a folder, a glob), a Hugging Face `datasets` folder, a Dataset factory; `rows` equal to
`default_collate` of `items`, in values and dtypes; a source read through within its cache bound. The bad
inputs are in test_sources_refused.py."""

from __future__ import annotations

import io
import pickle
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import default_collate

from prefect_elastic.data.arrow_stream import scan_stream
from prefect_elastic.data.sources import FieldInfo, SourceInfo, inspect_source, only_fields, open_source
from prefect_elastic.dataset import write_npz

from .. import sources_factories

ROWS = 60


def table(start: int = 0, rows: int = ROWS) -> pa.Table:
    """Columns of every sort: numbers, a fixed-size list, token lists of varying length, strings."""
    index = np.arange(start, start + rows)
    return pa.table(
        {
            "label": pa.array(index % 5, pa.int64()),
            "weight": pa.array(index / 10, pa.float32()),
            "flag": pa.array(index % 2 == 0),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(index, 3).astype(np.float32)), 3),
            "tokens": pa.array([list(range(i % 4 + 1)) for i in index], pa.list_(pa.int64())),
            "text": pa.array([f"sample {i}" for i in index]),
        }
    )


FIXED = ["label", "weight", "flag", "vec"]


def assert_rows_are_collated_items(info: SourceInfo, indices: list[int]) -> None:
    """`rows` holds what `default_collate(items)` holds: the same values and dtypes, in the asked order."""
    source = open_source(info)
    rows = source.rows(indices)
    assert rows is not None
    collated = default_collate(source.items(indices))
    assert set(rows) == set(collated) == set(info.names)
    for name, value in rows.items():
        tensor = torch.from_numpy(value)
        assert tensor.dtype == collated[name].dtype, name
        assert torch.equal(tensor, collated[name]), name
        assert tuple(value.shape) == (len(indices), *(info.field(name).shape or ()))  # type: ignore[union-attr]


def test_npz_files_are_inspected_and_read_by_rows(tmp_path: Path) -> None:
    x = np.arange(50 * 6, dtype=np.float32).reshape(50, 2, 3)
    y = np.arange(50, dtype=np.int64) % 7
    write_npz(str(tmp_path / "a.npz"), x[:20], y[:20])
    write_npz(str(tmp_path / "b.npz"), x[20:], y[20:])
    info = inspect_source("eval_dataset", str(tmp_path))
    assert (info.kind, info.length, info.setting) == ("npz", 50, "eval_dataset")
    assert info.fields == (FieldInfo("x", (2, 3), "<f4"), FieldInfo("y", (), "<i8"))
    assert sum(info.blocks) == 50 and not info.object_store and not info.tuple_items
    indices = [49, 0, 19, 20, 33, 0]
    source = open_source(info)
    items = source.items(indices)
    assert [int(item["y"]) for item in items] == [int(y[i]) for i in indices]
    assert isinstance(items[0]["y"], np.int64) and np.array_equal(items[2]["x"], x[19])
    assert_rows_are_collated_items(info, indices)


def test_npz_blocks_stay_within_a_file_and_near_the_block_size(tmp_path: Path) -> None:
    from prefect_elastic.data import npz_source

    x = np.zeros((3000, 1024), dtype=np.float32)  # 4 KiB a row: 2048 rows make a block of 8 MiB
    write_npz(str(tmp_path / "big.npz"), x, np.zeros(3000, dtype=np.int64))
    write_npz(str(tmp_path / "small.npz"), x[:10], np.zeros(10, dtype=np.int64))
    info = inspect_source("dataset", str(tmp_path))
    per_block = npz_source.BLOCK_BYTES // (4096 + 8)
    assert info.blocks == (per_block, 3000 - per_block, 10)


def write_parquet(path: Path, start: int = 0, rows: int = ROWS, row_group: int = 16) -> None:
    pq.write_table(table(start, rows), path, row_group_size=row_group)


def test_one_parquet_file_gives_its_columns_as_fields(tmp_path: Path) -> None:
    write_parquet(tmp_path / "train.parquet")
    info = inspect_source("dataset", str(tmp_path / "train.parquet"))
    assert (info.kind, info.length, info.blocks) == ("parquet", ROWS, (16, 16, 16, 12))
    assert info.fields == (
        FieldInfo("label", (), "<i8"),
        FieldInfo("weight", (), "<f4"),
        FieldInfo("flag", (), "|b1"),
        FieldInfo("vec", (3,), "<f4"),
        FieldInfo("tokens", None, "<i8"),  # lengths vary
        FieldInfo("text", None, None),  # not a number
    )
    source = open_source(info)
    assert len(source) == ROWS and source.rows([0, 1]) is None  # (tokens and text do not stack)
    item = source.items([37])[0]
    assert isinstance(item["label"], np.int64) and item["label"] == 37 % 5
    assert isinstance(item["weight"], np.float32) and item["weight"] == np.float32(3.7)
    assert isinstance(item["flag"], np.bool_) and not item["flag"]
    assert item["vec"].dtype == np.float32 and item["vec"].tolist() == [37.0] * 3
    assert item["tokens"].dtype == np.int64 and item["tokens"].tolist() == list(range(37 % 4 + 1))
    assert item["text"] == "sample 37"
    collated = default_collate([{k: v for k, v in i.items() if k != "tokens"} for i in source.items([3, 4])])
    assert collated["weight"].dtype == torch.float32 and collated["label"].dtype == torch.int64
    assert collated["text"] == ["sample 3", "sample 4"]


def test_the_fixed_fields_of_a_parquet_file_come_as_rows(tmp_path: Path) -> None:
    write_parquet(tmp_path / "train.parquet")
    info = only_fields(inspect_source("dataset", str(tmp_path / "train.parquet")), FIXED)
    assert info.names == tuple(FIXED) and info.stackable
    assert_rows_are_collated_items(info, [59, 0, 17, 16, 15, 40, 17])


def test_a_parquet_folder_and_a_glob_read_their_files_in_sorted_order(tmp_path: Path) -> None:
    folder = tmp_path / "train"
    folder.mkdir()
    for i, name in enumerate(["part-1.parquet", "part-0.parquet", "part-2.parquet"]):
        write_parquet(folder / name, start=100 * int(name[5]), rows=20 + i, row_group=8)
    (folder / "_SUCCESS").write_text("")  # what a Spark job leaves beside its files
    sizes = {"part-0.parquet": 21, "part-1.parquet": 20, "part-2.parquet": 22}
    for value in (str(folder), f"file://{folder}/part-*.parquet"):
        info = inspect_source("dataset", value)
        assert info.length == sum(sizes.values()) and info.detail[0] == tuple(
            f"file://{folder}/{name}" for name in sorted(sizes)
        )
        assert info.blocks == (8, 8, 5, 8, 8, 4, 8, 8, 6)
        labels = [int(item["weight"] * 10 + 0.5) for item in open_source(info).items([0, 20, 21, 40, 41, 62])]
        assert labels == [0, 20, 100, 119, 200, 221]


def test_a_datasets_folder_reads_as_datasets_itself_reads_it(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "attention_mask": datasets.Sequence(datasets.Value("int8")),
            "label": datasets.ClassLabel(names=["neg", "pos"]),
            "emb": datasets.Sequence(datasets.Value("float32"), length=4),
            "image": datasets.Array2D((2, 3), "float32"),
            "text": datasets.Value("string"),
        }
    )
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, 90)
    data = {
        "input_ids": [list(range(n)) for n in lengths],
        "attention_mask": [[1] * n for n in lengths],
        "label": [int(n % 2) for n in lengths],
        "emb": rng.random((90, 4), dtype=np.float32).tolist(),
        "image": rng.random((90, 2, 3), dtype=np.float32).tolist(),
        "text": [f"review {i}" for i in range(90)],
    }
    written = datasets.Dataset.from_dict(data, features=features)
    written.save_to_disk(str(tmp_path / "train"), max_shard_size="2KB")
    assert len(list((tmp_path / "train").glob("*.arrow"))) > 1  # (several data files)
    info = inspect_source("dataset", str(tmp_path / "train"))
    assert (info.kind, info.length, sum(info.blocks)) == ("datasets", 90, 90)
    assert info.fields == (
        FieldInfo("input_ids", None, "<i8"),
        FieldInfo("attention_mask", None, "|i1"),
        FieldInfo("label", (), "<i8"),
        FieldInfo("emb", (4,), "<f4"),
        FieldInfo("image", (2, 3), "<f4"),
        FieldInfo("text", None, None),
    )
    indices = [89, 0, 45, 46, 3]
    items = open_source(info).items(indices)
    for i, item in zip(indices, items, strict=True):
        want = written[i]
        assert item["input_ids"].tolist() == want["input_ids"] and item["input_ids"].dtype == np.int64
        assert item["attention_mask"].dtype == np.int8 and item["label"] == want["label"]
        assert np.array_equal(item["emb"], np.asarray(want["emb"], np.float32))
        assert np.array_equal(item["image"], np.asarray(want["image"], np.float32))
        assert item["text"] == want["text"]
    assert_rows_are_collated_items(only_fields(info, ["label", "emb", "image"]), indices)


def test_the_message_headers_give_the_rows_of_every_record_batch() -> None:
    """`scan_stream` agrees with pyarrow on streams and files, compressed or with dictionaries."""
    data = pa.table({"a": np.arange(100), "s": pa.array(["x", "y"] * 50).dictionary_encode()})
    for new, options in [
        (pa.ipc.new_stream, None),
        (pa.ipc.new_file, None),
        (pa.ipc.new_stream, pa.ipc.IpcWriteOptions(compression="zstd")),
    ]:
        sink = pa.BufferOutputStream()
        with new(sink, data.schema, options=options) as writer:
            for batch in data.to_batches(max_chunksize=30):
                writer.write_batch(batch)
        layout = scan_stream(io.BytesIO(sink.getvalue().to_pybytes()))
        assert layout.rows == (30, 30, 30, 10) and layout.dictionaries


def test_a_factory_of_tuples_gives_its_items_as_they_are() -> None:
    info = inspect_source("dataset", "tests.sources_factories:pairs")
    assert (info.kind, info.length, info.tuple_items, info.blocks) == ("factory", 12, True, ())
    assert info.fields == (FieldInfo("0", None, "<f4"), FieldInfo("1", None, "<i8"))
    source = open_source(info)
    expected = sources_factories.Pairs()
    for got, want in zip(source.items([5, 2]), [expected[5], expected[2]], strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert source.rows([0, 1]) is None
    assert inspect_source("dataset", "tests.sources_factories:Factories.pairs").length == 12  # (dotted)


def test_a_factory_of_dicts_names_its_fields_by_key() -> None:
    info = inspect_source("dataset", "tests.sources_factories:named")
    assert not info.tuple_items
    assert info.fields == (
        FieldInfo("pixels", None, "|u1"),
        FieldInfo("weight", None, "<f8"),
        FieldInfo("label", None, "<i8"),
    )
    assert open_source(info).items([3])[0]["weight"] == 1.5


def test_a_factory_that_draws_builds_the_same_dataset_everywhere_and_moves_no_generator() -> None:
    torch.manual_seed(123)
    random.seed(123)
    before = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    info = inspect_source("dataset", "tests.sources_factories:drawn")
    first, second = open_source(info), open_source(info)
    assert torch.equal(first.items([4])[0][0], second.items([4])[0][0])
    assert torch.equal(torch.random.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def test_the_cache_holds_no_more_than_its_bound_while_a_source_is_read_through(tmp_path: Path) -> None:
    pq.write_table(table(0, 2000), tmp_path / "many.parquet", row_group_size=50)  # 40 row groups
    info = only_fields(inspect_source("dataset", str(tmp_path / "many.parquet")), FIXED)
    one_group = 50 * (8 + 4 + 1 + 12)
    source: Any = open_source(info, cache_bytes=3 * one_group)
    order = np.random.default_rng(1).permutation(2000).tolist()
    seen = []
    for start in range(0, 2000, 64):
        batch = order[start : start + 64]
        rows = source.rows(batch)
        assert source.cached_bytes <= 3 * one_group
        seen += (rows["vec"][:, 0]).astype(int).tolist()
        items = source.items(batch[:5])
        assert [int(item["vec"][0]) for item in items] == batch[:5]
        assert source.cached_bytes <= 3 * one_group
    assert seen == order
    assert source.cache.loads > 40  # (blocks were let go and read again: the cache did not grow to hold all)
    tiny: Any = open_source(info, cache_bytes=one_group // 2)  # smaller than a block: none is kept
    assert tiny.rows([0, 1999])["label"].tolist() == [0, 1999 % 5] and tiny.cached_bytes == 0


def test_a_source_info_and_an_open_source_cross_processes_by_pickle(tmp_path: Path) -> None:
    write_parquet(tmp_path / "train.parquet")
    info = inspect_source("dataset", str(tmp_path / "train.parquet"))
    source = open_source(info)
    source.items([0])
    again = pickle.loads(pickle.dumps(source))
    assert pickle.loads(pickle.dumps(info)) == info
    assert again.items([33])[0]["text"] == "sample 33"
    source.close()
    assert source.items([1])[0]["text"] == "sample 1"  # (files open again, lazily, after close)


def test_reads_from_two_threads_get_their_own_samples(tmp_path: Path) -> None:
    write_parquet(tmp_path / "train.parquet", rows=600, row_group=20)
    source = open_source(only_fields(inspect_source("dataset", str(tmp_path / "train.parquet")), FIXED), 2000)
    wrong: list[int] = []

    def read(seed: int) -> None:
        for indices in np.random.default_rng(seed).integers(0, 600, (40, 16)).tolist():
            rows = source.rows(indices)
            assert rows is not None
            if rows["vec"][:, 0].astype(int).tolist() != indices:
                wrong.append(seed)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong


def test_pyarrow_is_imported_only_by_a_source_that_needs_it(tmp_path: Path) -> None:
    """An `.npz` dataset or a factory trains where the `data` extra is not installed."""
    import subprocess
    import sys

    write_npz(str(tmp_path / "a.npz"), np.zeros((4, 2), np.float32), np.zeros(4, np.int64))
    script = (
        "import sys\n"
        "from prefect_elastic.data.sources import inspect_source, open_source\n"
        "for value in sys.argv[1:]:\n"
        "    open_source(inspect_source('dataset', value)).items([0, 3])\n"
        "assert 'pyarrow' not in sys.modules and 'datasets' not in sys.modules, 'imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a.npz"), "tests.sources_factories:pairs"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
