"""The torchrun-elastic baseline: the same model, data and kills as the prefect-elastic runs, under
`python -m torch.distributed.run` (DDP on gloo, checkpoint and restart).

Every function starts real torchrun agents (each in its own session), drives them from the JSON lines
their workers append (see torchrun_worker.py), and kills every process it started before returning, also
on error. Every wait is bounded: a recovery that does not come is reported, never waited for forever.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .torchrun_agents import StepLog, agents, free_port, prepare, worker_env

WORKER = Path(__file__).resolve().parent / "torchrun_worker.py"

# Rendezvous settings (c10d backend, --rdzv-conf); the options take whole seconds.
# - last_call_timeout: once min nodes are in, a rendezvous waits this long for more. The default 30 s is
#   paid at start and on every restart of an --nnodes=1:2 job that has one node; 1 s is the least allowed.
# - keep_alive_interval x keep_alive_max_attempt: how long a dead node stays a participant (default
#   5 x 3 = 15 s), which a shrinking job waits out. A node sends a heartbeat only every 1 to 2 intervals,
#   so max_attempt 2 declares live nodes dead on a busy machine: a joining node then drops the running
#   node from the rendezvous and forms a second, separate group (seen here: two world-1 jobs training side
#   by side on one checkpoint). 1 x 5 leaves a margin.
RDZV_CONF = "last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=5"

# torch >= 2.4 shares the agent's rendezvous TCPStore with the workers, with no per-restart key prefix:
# after a restart the new workers read the dead group's keys and init_process_group fails or hangs.
# Setting this makes rank 0 of every restart host a fresh store on a free port instead.
FRESH_STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(
    workload: str,
    data: str,
    log_file: Path,
    checkpoint: Path,
    *,
    port: int,
    nproc: int = 2,
    nnodes: str = "1:2",
    max_restarts: int = 10,
    steps: int = 1_000_000,
    checkpoint_every: int = 10,
    rdzv_conf: str = RDZV_CONF,
    is_host: bool | None = None,
    standalone: bool = False,
    run_id: str = "bench",
) -> list[str]:
    """The command line of one torchrun agent of an elastic job, everything bound to 127.0.0.1.

    `is_host` says whether this agent hosts the rendezvous store; left out, every agent on this machine
    tries to bind the endpoint and the first to start wins, which may be the one a benchmark kills.
    `standalone` makes it a fixed single-node job (`--standalone`, no elastic membership), for comparison."""
    if is_host is not None:
        rdzv_conf += f",is_host={str(is_host).lower()}"
    rendezvous = (
        ["--standalone"]
        if standalone
        else [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              f"--rdzv-id={run_id}", f"--rdzv-conf={rdzv_conf}"]
    )  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous,
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
        "--local-addr=127.0.0.1", "--monitor-interval=0.1", f"--log-dir={log_file.parent / 'torchelastic'}",
        str(WORKER), "--workload", workload, "--data", data, "--log-file", str(log_file),
        "--checkpoint", str(checkpoint), "--steps", str(steps), "--checkpoint-every", str(checkpoint_every),
    ]  # fmt: skip


def throughput(steps: list[dict[str, Any]], skip: int = 5) -> float | None:
    """Samples/s over one group's steps (all ranks' samples), leaving out the first `skip` steps."""
    done: dict[int, tuple[float, int]] = {}  # step -> (time its last rank finished it, samples of all ranks)
    for r in steps:
        t, n = done.get(r["step"], (0.0, 0))
        done[r["step"]] = (max(t, r["t"]), n + r["samples"])
    order = sorted(done)[skip:]
    if len(order) < 2:
        return None
    elapsed = done[order[-1]][0] - done[order[0]][0]
    return sum(done[s][1] for s in order[1:]) / elapsed


def progress(steplog: StepLog, restart: int, after: float = 0.0) -> int:
    """Steps completed by the group of restart count `restart` after time `after`."""
    return len({r["step"] for r in steplog.steps() if r["restart"] == restart and r["t"] > after})


def relative(records: list[dict[str, Any]], started: float) -> list[dict[str, Any]]:
    return [r | {"t": r["t"] - started} for r in records]


def recovery(
    workload: str,
    data: str,
    workdir: Path,
    kills: int = 5,
    limit: float = 60.0,
    *,
    steady_steps: int = 20,
    checkpoint_every: int = 10,
    share_store: bool = False,
    standalone: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Kill one of the two workers of a torchrun-elastic job `kills` times; time each recovery.

    One agent, `--nproc-per-node=2`: on a worker's death the agent stops the other one, re-rendezvous and
    restarts both, which resume from the last checkpoint. Per kill: `recovery_s` from the SIGKILL to the
    first step completed by the restarted group, `regained_s` to the first step past the last one done
    before the kill (the lost steps redone), `steps_lost`. Each kill comes `steady_steps` steps after the
    previous recovery plus a seeded 0..checkpoint_every-1 more, so it lands at any distance from the last
    checkpoint. `share_store=True` keeps torch's default store sharing (see FRESH_STORE_ENV) to show it
    fail; `standalone=True` runs `--standalone` instead of `--nnodes=1:2` (no last-call wait), to compare.
    """
    log_file, checkpoint, output = prepare(workdir, f"recovery-{workload}")
    command = torchrun_command(
        workload, data, log_file, checkpoint, port=free_port(), nproc=2,
        max_restarts=kills + 2, checkpoint_every=checkpoint_every, standalone=standalone,
    )  # fmt: skip
    env_extra = {} if share_store else FRESH_STORE_ENV
    rng = random.Random(seed)
    steplog = StepLog(log_file)
    result: dict[str, Any] = {
        "system": "torchrun-elastic",
        "workload": workload,
        "config": {"command": shlex.join(command), "env": {"OMP_NUM_THREADS": "1", **env_extra}},
        "checkpoint_every": checkpoint_every,
        "limit": limit,
        "loadavg_before": os.getloadavg(),
        "kills": [],
    }
    started = time.time()
    with agents(steplog) as group:
        agent = group.start(command, worker_env(env_extra), output)
        restart, since = 0, 0.0
        for k in range(kills):
            need = steady_steps + rng.randrange(checkpoint_every)

            def steady_again(s: StepLog, r: int = restart, t: float = since, n: int = need) -> bool:
                return progress(s, r, t) >= n or agent.poll() is not None

            waiting = time.monotonic()
            if not steplog.wait(steady_again, limit) or agent.poll() is not None:
                entry = result["kills"][-1] if k else result
                entry.update(steady=False, waited=time.monotonic() - waiting, agent_exit=agent.poll())
                break
            if k == 0:
                result["startup_s"] = min(r["t"] for r in steplog.steps()) - started
                result["steady_samples_per_s"] = throughput([r for r in steplog.steps() if r["restart"] == 0])
            group.refresh()
            pids = {r["rank"]: r["pid"] for r in steplog.events("start") if r["restart"] == restart}
            rank = k % 2  # alternate between the rank that checkpoints and the other
            t_kill = time.time()
            os.kill(pids[rank], signal.SIGKILL)
            steplog.poll()
            last_done = max((r["step"] for r in steplog.steps() if r["t"] <= t_kill), default=0)
            kill: dict[str, Any] = {"kill": k, "rank": rank, "pid": pids[rank], "t": t_kill - started}
            result["kills"].append(kill)

            def resumed(s: StepLog, r: int = restart) -> bool:
                return any(x["restart"] > r for x in s.steps()) or agent.poll() is not None

            if not steplog.wait(resumed, limit) or agent.poll() is not None:
                # Not within `limit` s, or never: the agent gave up (exit code in agent_exit).
                kill.update(recovered=False, waited=time.time() - t_kill, agent_exit=agent.poll())
                kill["restarts_seen"] = sorted({r["restart"] for r in steplog.events("start")})
                break
            first = min((r for r in steplog.steps() if r["restart"] > restart), key=lambda r: r["t"])
            ready = [r for r in steplog.events("ready") if r["restart"] == first["restart"]]
            starts = [r for r in steplog.events("start") if r["restart"] == first["restart"]]
            kill.update(
                recovered=True,
                recovery_s=first["t"] - t_kill,
                restarts=first["restart"] - restart,  # more than 1: restarted groups failed again
                workers_started_s=min(r["t"] for r in starts) - t_kill,  # after `import torch`
                workers_ready_s=max(r["t"] for r in ready) - t_kill,  # process group and checkpoint loaded
                last_step_before_kill=last_done,
                resume_step=ready[0]["resume_step"],
                steps_lost=last_done - ready[0]["resume_step"],
            )
            restart, since = first["restart"], first["t"]

            def regained(s: StepLog, r: int = restart, target: int = last_done + 1) -> bool:
                return any(x["restart"] == r and x["step"] >= target for x in s.steps())

            if not steplog.wait(regained, limit):
                kill.update(regained=False, waited=limit)
                break
            redone = [x["t"] for x in steplog.steps() if x["restart"] == restart and x["step"] > last_done]
            kill["regained_s"] = min(redone) - t_kill
        result["agent_exit"] = agent.poll()
    result["loadavg_after"] = os.getloadavg()  # other load on the machine skews every figure here
    steplog.poll()
    times = [k["recovery_s"] for k in result["kills"] if k.get("recovered")]
    if times:
        result["recovery_s"] = {"mean": statistics.mean(times), "min": min(times), "max": max(times)}
    result["steps"] = relative(steplog.steps(), started)
    result["agent_output"] = str(output)
    return result


def steady(
    workload: str,
    data: str,
    workdir: Path,
    steps: int = 60,
    limit: float = 120.0,
    *,
    nproc: int = 2,
    standalone: bool = True,
    skip: int = 5,
) -> dict[str, Any]:
    """Throughput of torchrun DDP with `nproc` processes (one agent, gloo) and no failure: `steps` global
    steps of 128 samples per process, no checkpoint. `standalone` (the default): `--standalone`, the fixed
    single-node group DDP is run with when nothing is elastic; False: the elastic configuration of
    `recovery` (`--nnodes=1:2`, c10d rendezvous). The whole run, start-up included, is bounded by `limit` s;
    every process is killed before this returns. Samples/s as `throughput` counts them, after `skip` steps.
    """
    log_file, checkpoint, output = prepare(workdir, f"steady-{workload}")
    command = torchrun_command(
        workload, data, log_file, checkpoint, port=free_port(), nproc=nproc, steps=steps,
        checkpoint_every=10**9, standalone=standalone, max_restarts=0,
    )  # fmt: skip
    steplog = StepLog(log_file)
    started = time.time()
    with agents(steplog) as group:
        agent = group.start(command, worker_env(FRESH_STORE_ENV), output)
        finished = steplog.wait(lambda s: agent.poll() is not None, limit, interval=0.1)
        agent_exit = agent.poll()
    steplog.poll()
    records = steplog.steps()
    first_group = [r for r in records if r["restart"] == 0]  # a failed worker restarts all from step 0
    ends: dict[int, float] = {}  # step -> time its last rank finished it
    for r in first_group:
        ends[r["step"]] = max(ends.get(r["step"], 0.0), r["t"])
    intervals = [b - a for a, b in itertools.pairwise(ends[k] for k in sorted(ends)[skip:])]
    done = len(ends)
    return {
        "system": "torchrun-ddp",
        "workload": workload,
        "nproc": nproc,
        "config": {"command": shlex.join(command), "env": {"OMP_NUM_THREADS": "1", **FRESH_STORE_ENV}},
        "finished": finished and agent_exit == 0 and done >= steps,
        "agent_exit": agent_exit,
        "waited": None if finished else limit,
        "steps_done": done,
        "restarts": max((r["restart"] for r in records), default=0),
        "startup_s": min(r["t"] for r in records) - started if records else None,
        "samples_per_s": throughput(first_group, skip),
        "median_step_ms": 1000 * statistics.median(intervals) if intervals else None,
        "loadavg": os.getloadavg(),
        "steps": relative(records, started),
    }


def timeline(
    workload: str,
    data: str,
    workdir: Path,
    kill_at: float,
    join_at: float,
    duration: float,
    *,
    checkpoint_every: int = 10,
    startup_limit: float = 120.0,
) -> dict[str, Any]:
    """Two torchrun agents (nodes) of one worker each on one c10d rendezvous, `--nnodes=1:2`.

    At `kill_at` s the second node dies (its agent and worker SIGKILLed at once): the survivor's worker
    fails in its next all-reduce, its agent restarts it, and once the dead node's heartbeats expire the
    rendezvous closes with one node: the job goes on with world 1 from the last checkpoint. At `join_at` s
    a new agent joins the same endpoint; the survivor's agent sees a node waiting, restarts its worker, and
    the group re-forms with world 2 (again from the last checkpoint). The first agent hosts the rendezvous
    store, as the endpoint host does on a real cluster; killing it instead ends the job (the store dies with
    it), so the second node is the one that dies. `kill_at`, `join_at` and `duration` count from the
    group's first step, as prefect-elastic's timeline does: torchrun's start-up (docs/benchmarks.md, "What
    the figures say": the plot) is not in them. If no step comes within `startup_limit` s, nothing is
    killed and the result says so (`started` False). Times in the result are seconds from the start of the
    first agent.
    """
    log_file, checkpoint, output = prepare(workdir, f"timeline-{workload}")
    port = free_port()

    def command(is_host: bool) -> list[str]:
        return torchrun_command(
            workload, data, log_file, checkpoint, port=port, nproc=1, max_restarts=100,
            checkpoint_every=checkpoint_every, is_host=is_host,
        )  # fmt: skip

    def until(t: float) -> None:
        steplog.wait(lambda s: False, max(0.0, t - (time.time() - started)), interval=0.1)

    env = worker_env(FRESH_STORE_ENV)
    steplog = StepLog(log_file)
    events: list[dict[str, Any]] = []
    started = time.time()
    with agents(steplog) as group:
        host = group.start(command(is_host=True), env, output)
        group.start(command(is_host=False), env, output)
        node = group.procs[-1]
        events.append({"event": "agents_started", "agents": 2, "t": time.time() - started})
        stepping = steplog.wait(lambda s: bool(s.steps()) or host.poll() is not None, startup_limit)
        t_kill = t_join = float("inf")
        if stepping and host.poll() is None:
            first = min(r["t"] for r in steplog.steps()) - started
            until(first + kill_at)
            killed = group.kill_agent(node)
            t_kill = time.time() - started
            events.append({"event": "kill", "pids": killed, "t": t_kill})
            until(first + join_at)
            group.start(command(is_host=False), env, output)
            t_join = time.time() - started
            events.append({"event": "join", "t": t_join})
            until(first + duration)
        host_exit = host.poll()
    steplog.poll()
    keep = ("restart", "rank", "world", "pid", "resume_step")
    for name in ("start", "ready"):
        for r in steplog.events(name):
            worker = {k: r[k] for k in keep if k in r}
            events.append({"event": f"worker_{name}", "t": r["t"] - started, **worker})
    events.sort(key=lambda e: e["t"])
    steps = relative(steplog.steps(), started)
    shrunk = [s["t"] for s in steps if s["t"] > t_kill and s["world"] == 1]
    grown = [s["t"] for s in steps if s["t"] > t_join and s["world"] == 2]
    return {
        "system": "torchrun-elastic",
        "workload": workload,
        "config": {
            "host": shlex.join(command(is_host=True)),
            "nodes": shlex.join(command(is_host=False)),
            "env": {"OMP_NUM_THREADS": "1", **FRESH_STORE_ENV},
        },
        "kill_at": kill_at,
        "join_at": join_at,
        "duration": duration,
        "started": math.isfinite(t_kill),  # a step came within `startup_limit` s, and the kill was made
        "shrink_s": min(shrunk) - t_kill if shrunk else None,  # kill -> first step of the world-1 group
        "grow_s": min(grown) - t_join if grown else None,  # join -> first step of the world-2 group
        "split_brain": overlapping_groups(steps),
        "host_agent_exit": host_exit,
        "loadavg_after": os.getloadavg(),
        "events": events,
        "steps": steps,
        "agent_output": str(output),
    }


def overlapping_groups(steps: list[dict[str, Any]]) -> bool:
    """Whether two rank-0 workers trained at the same time, i.e. two separate groups existed at once."""
    spans: dict[int, tuple[float, float]] = {}
    for r in steps:
        if r["rank"] == 0:
            lo, hi = spans.get(r["pid"], (r["t"], r["t"]))
            spans[r["pid"]] = (min(lo, r["t"]), max(hi, r["t"]))
    ordered = sorted(spans.values())
    return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(ordered))


if __name__ == "__main__":
    import argparse
    import tempfile

    from .workloads import write_dataset

    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description="torchrun-elastic baseline runs, for trying them out")
    parser.add_argument("what", nargs="?", default="recovery", choices=["recovery", "timeline", "steady"])
    parser.add_argument("--workload", default="cnn")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="steady: global steps")
    parser.add_argument("--limit", type=float, default=60.0)
    parser.add_argument("--share-store", action="store_true", help="torch's default store sharing")
    parser.add_argument("--standalone", action="store_true", help="recovery with --standalone")
    parser.add_argument(
        "--times", default="10,25,40", help="timeline: kill_at,join_at,duration (s from the first step)"
    )
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--full", action="store_true", help="print the per-step log too")
    cli = parser.parse_args()
    workdir = Path(cli.workdir or tempfile.mkdtemp(prefix="torchrun-bench-"))
    dataset = write_dataset(workdir / f"data-{cli.samples}.npz", cli.samples)
    if cli.what == "recovery":
        out = recovery(
            cli.workload, dataset, workdir, cli.kills, cli.limit,
            share_store=cli.share_store, standalone=cli.standalone,
        )  # fmt: skip
    elif cli.what == "timeline":
        kill_at, join_at, duration = (float(x) for x in cli.times.split(","))
        out = timeline(cli.workload, dataset, workdir, kill_at, join_at, duration)
    else:
        out = steady(cli.workload, dataset, workdir, steps=cli.steps, limit=cli.limit)
    if not cli.full:
        out["steps"] = f"{len(out['steps'])} records"
    print(json.dumps(out, indent=1))
