"""The local harness: a cluster of real processes on this machine, for demos, tests and users trying
their jobs before they take them to a real cluster.

- `cluster.LocalElasticCluster`: a Dask scheduler with static and elastic worker processes on 127.0.0.1,
  which can add, kill (SIGKILL, SIGSTOP, with or without the nanny restarting) and retire workers, with
  TLS between all of them if asked (`security=True`); `launch`: how each of its processes starts;
- `faults.FaultSchedule`: such actions at given steps of a training run (`train(..., faults=...)`);
- `push_faults.KillBetweenPushes`: a worker plugin that SIGKILLs a worker after its push to one shard and
  before its push to the next (the one fault no outside signal can place);
- `prefect_server.PrefectServer`: a local `prefect server start` (SQLite or PostgreSQL, its own
  PREFECT_HOME); `postgres.LocalPostgres`: a throwaway PostgreSQL server for it;
- `slurm.LocalSlurm`: a real SLURM controller with two nodes on 127.0.0.1, for the SLURM tests;
- `slow`: a straggler (a worker slowed by a factor), and the data servers' hooks (`ServerHooks`) as worker
  plugins: slowed shards, a hand-over or a start held, a worker killed at a fence;
- `netns`: network namespaces on a bridge, whose links a test cuts and heals (network partitions);
- `chaos`: the chaos soak's schedule (every fault kind, in rounds) and its figures;
- `demo`: the README's demo (`prefect-elastic demo`);
- `processes`: starting and stopping the process groups the others run.

The engine (coordinator, data servers, compute loops, controller) never imports this subpackage: it runs
on any Dask cluster. Only the entry points for people import it: `cluster.connection.connect` (by its
import path) when no cluster is given, the command line, the tests and the benchmarks.
"""
