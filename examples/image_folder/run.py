"""Train job.yaml on a local elastic cluster started here, on the image folder make_images.py wrote.

python run.py [--data /tmp/prefect-elastic/images] [--epochs N] [--output model.pt] [--summary run.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import yaml

from prefect_elastic import ElasticJob, train
from prefect_elastic.local.cluster import LocalElasticCluster

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=None, help="the folder make_images.py wrote ($IMAGE_FOLDER or images/)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="instead of job.yaml's")
    parser.add_argument("--output", type=Path, default=None, help="where to save the trained state_dict")
    parser.add_argument("--summary", type=Path, default=None, help="a JSON file of steps and losses")
    args = parser.parse_args()

    spec = yaml.safe_load((HERE / "job.yaml").read_text())
    if args.data is not None:  # read by data.py, here and on the workers (they inherit this environment)
        os.environ["IMAGE_FOLDER"] = str(args.data.resolve())
    if args.epochs is not None:
        spec["epochs"] = args.epochs
    job = ElasticJob(**spec)
    # The workers import `model` and `data` from this folder: its path goes first on theirs.
    with LocalElasticCluster(static_workers=2, elastic_workers=1, env={"PYTHONPATH": str(HERE)}) as cluster:
        result = train(job, cluster=cluster)
    print(f"trained {result.steps} of {result.total_steps} steps in {result.elapsed:.1f} s: "
          f"loss {result.history[0]:.4f} -> {result.history[-1]:.4f}")  # fmt: skip
    if args.output is not None:
        torch.save(result.state_dict, args.output)
    if args.summary is not None:
        summary = {
            "steps": result.steps,
            "total_steps": result.total_steps,
            "total_batches": result.total_batches,
            "batch_ids": sorted(entry.batch_id for entry in result.ledger),
            "history": result.history,
        }
        args.summary.write_text(json.dumps(summary))
    sys.exit(0 if result.steps == result.total_steps else 1)


if __name__ == "__main__":
    main()
