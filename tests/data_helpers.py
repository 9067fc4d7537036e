"""What the data tests train on, as users keep it: the digits as Parquet and as a `datasets` folder,
token lists of varying length (a text classifier's data, padded by a collate of the user's), an image
folder of PNGs decoded with Pillow and augmented at random per sample, and the models and factories a job
names by import path (`tests.data_helpers:...`).

A factory takes no arguments, and runs in processes started long before a test (the cluster's workers):
`images()` reads a folder of this machine's temporary directory that the first caller writes, the same
bytes whoever writes it (seeded), moved into place whole so that no reader sees half of it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

CLASSES = 4
SIDE = 12  # the PNGs' side; the random crop takes CROP of it
CROP = 8
VOCAB = 50
PACE = 0.015  # seconds a forward sleeps: the cluster tests' runs last long enough to kill a worker in


def write_digits_parquet(folder: Path, files: int = 3, row_group: int = 100) -> str:
    """The digits as `files` Parquet files of row groups of `row_group` rows: x a fixed list of 64 floats,
    y an int64 label; the URL of the folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (np.asarray(digits.data, dtype=np.float32) / np.float32(16.0)).reshape(-1, 64)
    y = np.asarray(digits.target, dtype=np.int64)
    folder.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(np.array_split(np.arange(len(x)), files)):
        table = pa.table({"x": pa.array(list(x[rows]), type=pa.list_(pa.float32(), 64)), "y": y[rows]})
        pq.write_table(table, folder / f"part-{i:03d}.parquet", row_group_size=row_group)
    return f"file://{folder}"


def token_rows(count: int = 600, seed: int = 0) -> dict[str, list[Any]]:
    """Token lists of 3 to 12 ids whose label is whether id 7 appears: a text classifier's columns."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, VOCAB, size=int(rng.integers(3, 13))).tolist() for _ in range(count)]
    return {
        "input_ids": ids,
        "attention_mask": [[1] * len(row) for row in ids],
        "label": [int(7 in row) for row in ids],
    }


def write_tokens_folder(folder: Path) -> str:
    """The token rows as a folder written by `datasets.Dataset.save_to_disk`."""
    import datasets

    datasets.Dataset.from_dict(token_rows()).save_to_disk(str(folder))
    return str(folder)


def pad_batch(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A user's collate: token lists padded with 0 to the longest of the batch."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n] = torch.as_tensor(np.asarray(s["input_ids"]), dtype=torch.int64)
        mask[i, :n] = torch.as_tensor(np.asarray(s["attention_mask"]), dtype=torch.int64)
    labels = torch.as_tensor(np.asarray([s["label"] for s in samples]), dtype=torch.int64)
    return {"input_ids": ids, "attention_mask": mask, "label": labels}


class _TextClassifier(nn.Module):
    """Takes `input_ids` and `attention_mask` as keywords and computes its own loss from `labels`, as a
    Hugging Face classifier does; dropout draws from torch's generator."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 2)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        time.sleep(PACE)
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        logits = self.out(self.drop(pooled))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def text_classifier() -> nn.Module:
    return _TextClassifier()


class _Paced(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(PACE)
        return super().forward(x)


def digits_flat_mlp() -> nn.Module:
    return _Paced(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def write_images(folder: Path, per_class: int = 80, seed: int = 0) -> str:
    """An image folder as torchvision's ImageFolder reads it: one subfolder of PNGs per class, each image
    a noisy pattern of its class."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label in range(CLASSES):
        (folder / f"class{label}").mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            pattern = np.zeros((SIDE, SIDE, 3), dtype=np.float32)
            pattern[:, :, label % 3] = 0.6 if label < 3 else 0.3
            noisy = np.clip(pattern + rng.normal(0, 0.2, size=pattern.shape), 0, 1)
            Image.fromarray((noisy * 255).astype(np.uint8)).save(folder / f"class{label}" / f"{k:03d}.png")
    return str(folder)


class ImageFolderDataset(Dataset[tuple[torch.Tensor, int]]):
    """A user's own Dataset: PNGs decoded with Pillow, a random crop and a random flip drawn from torch's
    global generator (as torchvision's RandomCrop and RandomHorizontalFlip draw)."""

    def __init__(self, root: str) -> None:
        self.files = sorted(Path(root).glob("*/*.png"))
        self.classes = sorted({f.parent.name for f in self.files})

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path = self.files[index]
        with Image.open(path) as image:
            pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)
        pixels = pixels.permute(2, 0, 1)
        top, left = (int(v) for v in torch.randint(0, SIDE - CROP + 1, (2,)))
        pixels = pixels[:, top : top + CROP, left : left + CROP]
        if torch.rand(()) < 0.5:
            pixels = pixels.flip(-1)
        return pixels.contiguous(), self.classes.index(path.parent.name)


def image_root() -> Path:
    """The tests' image folder, written by the first process that needs it."""
    root = Path(tempfile.gettempdir()) / "prefect-elastic-test-images-v2"
    if not root.exists():
        scratch = root.with_name(f"{root.name}.{uuid.uuid4().hex}")
        write_images(scratch)
        try:
            os.rename(scratch, root)
        except OSError:  # (another process moved its copy in first: the same bytes)
            shutil.rmtree(scratch, ignore_errors=True)
    return root


def images() -> ImageFolderDataset:
    """The factory a job names (`dataset="tests.data_helpers:images"`)."""
    return ImageFolderDataset(str(image_root()))


def image_cnn() -> nn.Module:
    return _Paced(
        nn.Conv2d(3, 6, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(6 * (CROP // 2) ** 2, CLASSES),
    )


def write_tokens_folder_in_blocks(folder: Path, block_rows: int = 100, files: int = 2) -> str:
    """The token rows as a `save_to_disk` folder of `files` Arrow files of record batches of `block_rows`
    rows (the blocks of a shuffle by blocks: `datasets` writes batches of 1000 rows by default, so the
    tests' 600 rows would be one block)."""
    import datasets
    import datasets.config

    default = datasets.config.DEFAULT_MAX_BATCH_SIZE
    datasets.config.DEFAULT_MAX_BATCH_SIZE = block_rows  # (what `save_to_disk` writes its batches by)
    try:
        datasets.Dataset.from_dict(token_rows()).save_to_disk(str(folder), num_shards=files)
    finally:
        datasets.config.DEFAULT_MAX_BATCH_SIZE = default
    return str(folder)
