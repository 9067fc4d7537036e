"""The `prefect-elastic` command: `prefect-elastic demo`, `prefect-elastic train job.yaml`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .errors import ElasticError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefect-elastic", description="Elastic PyTorch training on Dask.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train on a local cluster while a worker is killed and one joins")
    demo.add_argument("--policy", choices=["rollback", "reassign"], default="reassign")
    demo.add_argument("--epochs", type=int, default=20)
    demo.add_argument(
        "--keep-server", action="store_true", help="keep the local Prefect server up at the end"
    )
    run = sub.add_parser("train", help="run the job of a YAML file through the Prefect flow")
    run.add_argument("job", help="path of the job's YAML file (the fields of ElasticJob)")
    run.add_argument("--address", help="scheduler address of a running Dask cluster (default: a local one)")
    run.add_argument("--output", help="fsspec URL to write the final state_dict to (torch.save)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.command == "demo":
        from .local.demo import run_demo

        return 0 if run_demo(args.policy, args.epochs, args.keep_server) else 1

    from .flows import elastic_training
    from .job import ElasticJob
    from .local.demo import prefect_api

    try:
        ElasticJob.from_yaml(args.job)  # a bad file is reported here, before any server starts
    except ElasticError as exc:
        print(f"prefect-elastic: {exc}", file=sys.stderr)
        return 2
    with prefect_api(print, keep=False) as ui_url:
        state = elastic_training(args.job, address=args.address, output=args.output, return_state=True)
        print(f"flow run {state.state_details.flow_run_id}: {state.type.value}")
        print(f"  {ui_url.rstrip('/')}/runs/flow-run/{state.state_details.flow_run_id}")
    if not state.is_completed():
        print(f"prefect-elastic: {state.message}", file=sys.stderr)
        return 1
    summary: dict[str, Any] = state.result()  # type: ignore[assignment]
    loss = summary["final_loss"]
    print(f"trained {summary['steps']} steps, final loss {loss:.4f}, model written to {summary['output']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
