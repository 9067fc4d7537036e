"""The overlapped step against the whole push and the plain loop, side by side in one run.

`python -m benchmarks.overlap_push [--workloads resnet18,gpt2,mlp-50,mlp,cnn-20,transformer] [--repeats 3]`:
for each workload, one compute worker (one micro-batch a step, as the steady group measures) with its
gradients pushed whole after backward, the same with `overlap_push` (buckets leave during backward), and
the plain PyTorch loop, in alternating order within each repeat; the ratios over plain are the medians of
each repeat's ratios. The table goes into docs/benchmarks.md between its marks. The ResNet-18 and the GPT-2
classifier need the bench extra (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from . import elastic
from .plain import plain_process
from .report import replace_between
from .workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent
NO_SNAPSHOTS = 1e6  # a liveness interval longer than any run: no periodic snapshot
START = "<!-- overlap-push:start (written by python -m benchmarks.overlap_push; edit outside these marks) -->"
END = "<!-- overlap-push:end -->"
# Epochs by workload: a steady run of each (its length: docs/benchmarks.md, "Gradients that leave during
# backward").
EPOCHS = {"resnet18": 1, "gpt2": 1, "mlp-50": 1, "mlp": 10, "cnn-20": 5, "transformer": 5}
SAMPLES = 16384  # the MNIST-shaped data of the steady group
EXTRA_SAMPLES = {"resnet18": 4096, "gpt2": 2048}  # their own data: 128 steps of 32, of 16
KINDS = ("plain", "whole", "overlap")


def measure(
    pool: elastic.ClusterPool, workload: str, workdir: Path, repeats: int, smoke: bool = False
) -> dict[str, Any]:
    samples = EXTRA_SAMPLES.get(workload, SAMPLES)
    if smoke:
        samples //= 8
    data = WORKLOADS[workload].dataset(workdir, samples)
    epochs = 1 if smoke else EPOCHS[workload]
    steps = epochs * (samples // WORKLOADS[workload].batch)
    got: dict[str, list[float]] = {k: [] for k in KINDS}
    fixed: dict[str, list[float]] = {"whole": [], "overlap": []}
    for i in range(repeats):
        for kind in KINDS if i % 2 == 0 else KINDS[::-1]:
            if kind == "plain":
                run = plain_process(workload, data, steps)
            else:
                run = elastic.steady(
                    pool, workload, data, epochs, NO_SNAPSHOTS, overlap_push=kind == "overlap"
                )
                fixed[kind].append(run.get("fixed_ms") or float("nan"))
            got[kind].append(run["samples_per_s"])
            print(f"{workload} #{i} {kind}: {run['samples_per_s']:.1f} samples/s", flush=True)
            if kind != "plain":  # (where the step's time went: the loop's phases and the shards', ms a step)
                phases = {k: round(v, 1) for k, v in run.get("phase_ms", {}).items()}
                shards = [{k: round(v, 1) for k, v in s.items()} for s in run.get("shard_ms", [])]
                print(f"  step {run.get('step_ms', 0):.1f} ms; loop {phases}; shards {shards}", flush=True)
    return {
        "workload": workload,
        "samples_per_s": {k: statistics.median(v) for k, v in got.items()},
        "whole_over_plain": statistics.median(w / p for w, p in zip(got["whole"], got["plain"], strict=True)),
        "overlap_over_plain": statistics.median(
            o / p for o, p in zip(got["overlap"], got["plain"], strict=True)
        ),
        "overlap_over_whole": statistics.median(
            o / w for o, w in zip(got["overlap"], got["whole"], strict=True)
        ),
        "fixed_ms": {k: statistics.median(v) for k, v in fixed.items()},
    }


def table(rows: list[dict[str, Any]], repeats: int, load: float) -> str:
    lines = [
        f"Made by `python -m benchmarks.overlap_push --repeats {repeats}` (2 cores, no GPU, a 1-minute load "
        f"average of {load:.1f} before it began): one compute worker, one micro-batch a step, no periodic "
        "snapshot; each ratio the median of the repeats' ratios, the runs of a repeat next to each other.",
        "",
        "| workload | plain (samples/s) | whole push | overlapped | whole over plain | overlapped over plain "
        "| overlapped over whole | fixed cost a step, whole / overlapped (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, f = r["samples_per_s"], r["fixed_ms"]
        lines.append(
            f"| {r['workload']} | {s['plain']:.1f} | {s['whole']:.1f} | {s['overlap']:.1f} | "
            f"{r['whole_over_plain']:.2f} | {r['overlap_over_plain']:.2f} | {r['overlap_over_whole']:.2f} | "
            f"{f['whole']:.1f} / {f['overlap']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="resnet18,gpt2,mlp-50,mlp,cnn-20,transformer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/prefect-elastic-bench"))
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the code, not the speed")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in EPOCHS]
    if unknown:
        parser.error(f"--workloads: {unknown} unknown; give some of {sorted(EPOCHS)}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    load = os.getloadavg()[0]
    args.data_dir.mkdir(parents=True, exist_ok=True)
    pool = elastic.ClusterPool()
    try:
        rows = [measure(pool, w, args.data_dir, args.repeats, args.smoke) for w in workloads]
    finally:
        pool.close()
    block = table(rows, args.repeats, load)
    if args.smoke:
        block = "(smoke sizes: the numbers mean nothing)\n\n" + block
    print(block)
    replace_between(args.docs, START, END, block)
    print(f"wrote the table into {args.docs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
