"""Write a noisy sine as a prefect-elastic dataset: `--shards` .npz files of float32 `x` and `y`, (n, 1) each.

python make_data.py --out /tmp/prefect-elastic/sine [--samples 4096] [--shards 2] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def write(out: Path, samples: int, shards: int, seed: int) -> list[Path]:
    if samples < shards or shards < 1:
        raise SystemExit(f"make_data.py: --samples {samples} must be at least --shards {shards} (>= 1)")
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3.0, 3.0, size=(samples, 1)).astype(np.float32)
    y = (np.sin(x) + rng.normal(0.0, 0.05, size=x.shape)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, (xs, ys) in enumerate(zip(np.array_split(x, shards), np.array_split(y, shards), strict=True)):
        path = out / f"part-{i:03d}.npz"  # read in sorted file order: the sample numbering is fixed
        np.savez(path, x=xs, y=ys)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the .npz shards into")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write(args.out, args.samples, args.shards, args.seed):
        print(path)
    print(f"dataset URL: file://{args.out.resolve()}")


if __name__ == "__main__":
    main()
