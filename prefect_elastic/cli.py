"""The `prefect-elastic` command: `prefect-elastic demo`, `prefect-elastic train job.yaml`."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from .errors import ElasticError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefect-elastic", description="Elastic PyTorch training on Dask.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train on a local cluster while a worker is killed and one joins")
    demo.add_argument("--policy", choices=["rollback", "reassign"], default="rollback")
    demo.add_argument("--epochs", type=int, default=6)
    run = sub.add_parser("train", help="train the job described by a YAML file")
    run.add_argument("job", help="path of the job's YAML file (the fields of ElasticJob)")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="scheduler address of a running Dask cluster")
    where.add_argument(
        "--local",
        metavar="STATIC,ELASTIC",
        help="start a local cluster with this many static and elastic workers, e.g. 2,2",
    )
    run.add_argument("--output", help="write the final state_dict here (torch.save)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "demo":
        from .demo import run_demo

        return 0 if run_demo(args.policy, args.epochs) else 1

    from .demo import ProgressLine
    from .training import train

    progress = ProgressLine("train")
    try:
        if args.local:
            from .cluster import LocalElasticCluster

            static, elastic = _counts(args.local)
            with LocalElasticCluster(static_workers=static, elastic_workers=elastic) as cluster:
                result = train(args.job, cluster=cluster, on_progress=progress, on_event=progress.event)
        else:
            result = train(args.job, address=args.address, on_progress=progress, on_event=progress.event)
    except ElasticError as exc:
        progress.close()
        print(f"prefect-elastic: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    progress.close()
    print(f"trained {result.steps} steps in {result.elapsed:.1f} s, final loss {result.history[-1]:.4f}")
    if args.output:
        torch.save(result.state_dict, args.output)
        print(f"parameters written to {args.output}")
    return 0


def _counts(text: str) -> tuple[int, int]:
    try:
        static, elastic = (int(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(
            f"--local {text!r}: give two numbers, static and elastic workers, e.g. --local 2,2"
        ) from None
    return static, elastic


if __name__ == "__main__":
    sys.exit(main())
