"""Write a small image folder of PNGs, one subfolder per class (as torchvision's ImageFolder reads it):
each image a noisy colour pattern of its class.

python make_images.py --out /tmp/prefect-elastic/images [--per-class 64] [--side 16] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ["red", "green", "blue", "stripes"]


def pattern(label: int, side: int) -> np.ndarray:
    image = np.zeros((side, side, 3), dtype=np.float32)
    if label < 3:
        image[:, :, label] = 0.7  # a plain colour
    else:
        image[::2, :, :] = 0.7  # grey horizontal stripes
    return image


def write(out: Path, per_class: int, side: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    for label, name in enumerate(CLASSES):
        (out / name).mkdir(parents=True, exist_ok=True)
        for k in range(per_class):
            noisy = np.clip(pattern(label, side) + rng.normal(0.0, 0.2, size=(side, side, 3)), 0.0, 1.0)
            Image.fromarray((noisy * 255).astype(np.uint8)).save(out / name / f"{k:04d}.png")
    return per_class * len(CLASSES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write the class folders into")
    parser.add_argument("--per-class", type=int, default=64)
    parser.add_argument("--side", type=int, default=16, help="the PNGs' side in pixels (data.py crops 12)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    count = write(args.out, args.per_class, args.side, args.seed)
    print(f"{count} PNGs in {len(CLASSES)} classes: {args.out.resolve()}")


if __name__ == "__main__":
    main()
