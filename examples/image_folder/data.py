"""Your own map-style torch Dataset, and the zero-argument factory a job names (`dataset: data:train_images`).

Each sample is decoded with Pillow and augmented by a random crop and a random horizontal flip drawn from
torch's global generator (as torchvision's RandomCrop and RandomHorizontalFlip draw). prefect-elastic seeds
that generator from (seed, epoch, the sample's index) while it reads a sample, so an augmented sample is
the same bits whichever worker reads it, after a failure too. (A generator of the Dataset's own would not
be: draw from the global ones.)

The factory runs in every process that reads the data (the compute workers' data processes), with no
arguments: it finds the folder in the environment variable IMAGE_FOLDER, or else in `images/` next to
this file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

CROP = 12  # the side of the random crop (make_images.py writes 16 x 16)
ENV = "IMAGE_FOLDER"
DEFAULT = Path(__file__).resolve().parent / "images"


class ImageFolderDataset(Dataset[tuple[torch.Tensor, int]]):
    """`root/<class>/<image>.png`, in sorted order; a sample: (a 3 x CROP x CROP float tensor, its class)."""

    def __init__(self, root: str | os.PathLike[str], crop: int = CROP) -> None:
        self.files = sorted(Path(root).glob("*/*.png"))
        if not self.files:
            raise FileNotFoundError(f"no PNGs under {root}/<class>/ (write them with make_images.py)")
        self.classes = sorted({f.parent.name for f in self.files})
        self.crop = crop

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path = self.files[index]
        with Image.open(path) as image:
            pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)
        pixels = pixels.permute(2, 0, 1)  # channels first
        height, width = pixels.shape[1:]
        top = int(torch.randint(0, height - self.crop + 1, ()))
        left = int(torch.randint(0, width - self.crop + 1, ()))
        pixels = pixels[:, top : top + self.crop, left : left + self.crop]
        if torch.rand(()) < 0.5:
            pixels = pixels.flip(-1)
        return pixels.contiguous(), self.classes.index(path.parent.name)


def train_images() -> ImageFolderDataset:
    """The factory the job names: the folder in $IMAGE_FOLDER, or `images/` next to this file."""
    return ImageFolderDataset(os.environ.get(ENV) or DEFAULT)
