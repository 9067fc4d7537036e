"""Train a prefect-elastic job on SLURM the Prefect way: the flow submits its own workers as SLURM jobs.

    python train_slurmcluster.py JOB.yaml --output model.pt --queue PARTITION

`dask_jobqueue.SLURMCluster` runs a Dask scheduler in this process and each worker as a SLURM job;
`static_workers` adds jobs that carry the `static` resource (the data servers and the coordinator live
there; never scaled down, no lifetime), and `adapt_kwargs` scales the elastic jobs between `minimum` and
`maximum`. Elastic workers get a `--lifetime` shorter than the walltime, so that they leave gracefully
before SLURM kills them; a job that ends (lifetime, walltime, scancel, pre-emption) is replaced by a new
one. Set PREFECT_API_URL to see the run in your Prefect server. See docs/slurm.md.
"""

from __future__ import annotations

import argparse
import sys

from prefect_elastic.flows import elastic_training


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="the job's YAML file (the fields of ElasticJob)")
    parser.add_argument("--output", help="fsspec URL to write the final state_dict to")
    parser.add_argument("--queue", help="SLURM partition (default: the cluster's default)")
    parser.add_argument("--static-workers", type=int, default=2)
    parser.add_argument("--minimum", type=int, default=1, help="fewest elastic workers")
    parser.add_argument("--maximum", type=int, default=8, help="most elastic workers")
    parser.add_argument("--cores", type=int, default=4, help="cores of each job")
    parser.add_argument("--memory", default="8GB", help="memory of each job")
    parser.add_argument("--walltime", default="01:00:00", help="walltime of each job")
    parser.add_argument(
        "--lifetime", default=None, help="elastic workers' lifetime (default: the walltime less 5 minutes)"
    )
    parser.add_argument("--host", default=None, help="address the scheduler and workers listen on")
    parser.add_argument("--log-directory", default=None, help="where the jobs' output goes")
    args = parser.parse_args(argv)

    hours, minutes, seconds = (int(part) for part in args.walltime.split(":"))
    walltime_s = 3600 * hours + 60 * minutes + seconds
    # Leave before SLURM's walltime kill: the worker retires gracefully and a new job takes its place.
    lifetime = args.lifetime or f"{max(60, walltime_s - 300)}s"
    worker_args = ["--lifetime", lifetime, "--lifetime-stagger", f"{min(120, walltime_s // 20)}s"]
    scheduler_options: dict[str, object] = {"dashboard_address": ":0"}
    if args.host:
        scheduler_options["host"] = args.host
        worker_args += ["--host", args.host]
    cluster_kwargs = {
        "cores": args.cores,
        "processes": 1,
        "memory": args.memory,
        "walltime": args.walltime,
        "queue": args.queue,
        "python": sys.executable,  # the jobs run this interpreter: prefect-elastic must be installed there
        "scheduler_options": scheduler_options,
        "worker_extra_args": worker_args,
        "log_directory": args.log_directory,
    }
    state = elastic_training(
        args.job,
        cluster_class="dask_jobqueue.SLURMCluster",
        cluster_kwargs=cluster_kwargs,
        static_workers=args.static_workers,
        adapt_kwargs={"minimum": args.minimum, "maximum": args.maximum},
        output=args.output,
        return_state=True,
    )
    print(f"flow run {state.state_details.flow_run_id}: {state.type.value}")
    return 0 if state.is_completed() else 1


if __name__ == "__main__":
    sys.exit(main())
