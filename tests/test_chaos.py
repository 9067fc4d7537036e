"""The chaos soak (issue 13): one training run over at least six worker processes takes at least 50 faults
of every kind the harness can inject: SIGKILL, SIGTERM, SIGSTOP and SIGCONT, nanny restarts, graceful
retires, joins, groups of joins, and static workers' SIGKILLs with standbys taking over. Sync mode under
both policies ends bitwise equal to the one-worker, no-fault run with every batch id committed once; async
mode commits every batch id once and reaches the loss of a sync run. No process is left behind.

The soak is `heavy`: .ci/run runs one in every CI run, after the main suite, its mode and policy picked by
the run's seed (`ELASTIC_CI_SEED`: successive runs go round the three, and the seed shuffles the faults);
the plan and the figures are checked here without a cluster. The figures of each run are printed at the
end of the test output (`pytest_terminal_summary` in conftest.py); `python -m benchmarks.soak` runs a
longer soak and writes its figures into docs/faults.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import time
import uuid
from collections import Counter

import psutil
import pytest

from prefect_elastic import TrainResult, train
from prefect_elastic.local.chaos import (
    GROUP,
    ROUND,
    chaos_schedule,
    fault_label,
    plan_rounds,
    soak_figures,
)
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultRecord, FaultSchedule
from prefect_elastic.local.netns import HostNetwork
from prefect_elastic.messages import EventKind, Progress

from .conftest import (
    CI_SEED,
    SOAK_FIGURES,
    References,
    assert_ledger_exactly_once,
    assert_same_parameters,
    make_job,
    rotated,
)
from .models import GATE
from .test_async import check_async

# 11 faults a round (a group of joins and a static kill with its new standby count 2 each);
# `python -m benchmarks.soak` runs more rounds and writes the figures into docs/faults.md.
ROUNDS = int(os.environ.get("ELASTIC_SOAK_ROUNDS", "5"))
EVERY = {"sync": 25, "async": 100}  # committed steps between faults (async commits one micro-batch a step)
PACE_S = "0.01"  # each forward pass on the soak's workers (not the reference's)
# One soak a CI run: the seed picks the mode and policy (in turn from one run to the next) and shuffles the
# faults; `ELASTIC_CI_SEED` runs a given one again, `python -m benchmarks.soak` runs all three.
SOAK_CASES = [("sync", "rollback"), ("sync", "reassign"), ("async", "reassign")]
# `ELASTIC_ALL_CASES=1` (as `python -m benchmarks.soak` sets it) runs all three.
SOAK_RUNS = [
    (*case, CI_SEED)
    for case in (SOAK_CASES if os.environ.get("ELASTIC_ALL_CASES") == "1" else [rotated(SOAK_CASES)])
]


# -- the plan, without a cluster --------------------------------------------------------------------------


def test_every_round_has_each_fault_kind_and_keeps_the_workers_within_bounds() -> None:
    plan = plan_rounds(seed=3, rounds=ROUNDS, start_alive=4)
    assert len(plan) == ROUNDS * len(ROUND)
    for r in range(ROUNDS):
        assert sorted(plan[r * len(ROUND) : (r + 1) * len(ROUND)]) == sorted(ROUND)
    alive = 4
    for action in plan:
        alive += {"kill": -1, "sigterm": -1, "retire": -1, "add": 1, "group": GROUP}.get(action, 0)
        assert 2 <= alive <= 6, plan
    assert plan != plan_rounds(seed=4, rounds=ROUNDS, start_alive=4), "the seed shuffles the rounds"
    with pytest.raises(ValueError, match="start_alive=1 must lie within"):
        plan_rounds(seed=3, rounds=1, start_alive=1)


def test_the_schedule_has_at_least_50_faults_and_alternates_the_static_roles() -> None:
    sync = chaos_schedule(seed=3, rounds=ROUNDS, every=10)
    processes = sum(f.count for f in sync.faults)
    assert processes >= 50, processes
    steps = [f.at_step for f in sync.faults]
    assert steps == sorted(steps) and steps[0] == 5
    roles = [f.role for f in sync.faults if f.role]
    assert roles[:2] == ["data-server-1", "coordinator"] and len(roles) == ROUNDS
    pauses = [f.seconds for f in sync.faults if f.kind == "pause"]
    assert len(pauses) == ROUNDS and all(0.4 <= s <= 2.5 for s in pauses)
    cuts = [f.seconds for f in sync.faults if f.kind == "partition"]
    assert len(cuts) == ROUNDS and all(2.0 <= s <= 5.0 for s in cuts)
    without = chaos_schedule(seed=3, rounds=ROUNDS, every=10, partitions=False)
    assert (
        not [f for f in without.faults if f.kind == "partition"]
        and len(without.faults) == len(sync.faults) - ROUNDS
    )


def test_the_figures_count_stalls_and_tell_faults_apart() -> None:
    records = [
        FaultRecord(1, "kill", "a", 0.0, int(signal.SIGKILL)),
        FaultRecord(2, "kill", "b", 0.0, int(signal.SIGTERM)),
        FaultRecord(3, "kill", "c", 0.0, int(signal.SIGKILL), "coordinator"),
        FaultRecord(4, "restart", "d", 0.0, int(signal.SIGKILL)),
    ]
    assert [fault_label(r) for r in records] == ["kill", "sigterm", "kill coordinator", "restart"]


# -- the soak ---------------------------------------------------------------------------------------------


class HoldForFaults:
    """Training waits (at the gate of `tests.models:env_paced_mlp`) `margin` steps before its end while
    faults of the schedule have not run yet (one due waits for a target: a worker to join), so that every
    planned fault hits a running job however slowly the machine starts processes."""

    def __init__(self, faults: FaultSchedule, margin: int, longest: float = 120.0) -> None:
        self.faults = faults
        self.margin = margin
        self.deadline: float | None = None
        self.longest = longest  # then training goes on, and the test says which faults did not run

    def __call__(self, progress: Progress) -> None:
        near_end = progress.committed_steps >= progress.total_steps - self.margin
        if near_end and self.faults.faults and progress.state == "running":
            self.deadline = self.deadline or time.monotonic() + self.longest
            if time.monotonic() < self.deadline:
                GATE.touch()
                return
        GATE.unlink(missing_ok=True)


def stall_lines(result: TrainResult, log: list[FaultRecord]) -> list[str]:
    """Every gap between commits longer than the liveness interval, with the faults and the events of
    survival detection within it (each with its reason, steps undone and seconds), in time order."""
    lines = []
    for step, (begin, end) in enumerate(itertools.pairwise(result.commit_times), start=1):
        if end - begin <= result.job.liveness_interval:
            continue
        lines.append(f"{end - begin:.2f} s after step {step}:")
        lines += [
            f"  +{r.time - begin:.2f} fault {fault_label(r)} {r.target}"
            for r in log
            if begin <= r.time <= end
        ]
        lines += [
            f"  +{e.time - begin:.2f} {e.kind} ({e.seconds:.2f} s, {e.steps_lost} undone) {e.reason}"
            for e in result.events
            if begin <= e.time <= end and e.kind != EventKind.SNAPSHOT
        ]
    return lines


def soak_processes(marker: str, since: float) -> list[psutil.Process]:
    """Every live process started for the soak's cluster. Those started as commands carry `marker` in their
    environment; those forked from the test session's fork server (`local.forkserver_process`) show the
    server's environment instead, and are found as this process's descendants started at `since` or later.
    The fork server itself serves the whole session, and is left out."""
    me = psutil.Process()
    descendants = me.children(recursive=True)
    found = {}
    for proc in [*psutil.process_iter(), *descendants]:
        try:
            if proc.ppid() == me.pid and "prefect_elastic.local.forkserver_process" in proc.cmdline():
                continue
            if proc.environ().get("ELASTIC_TESTS_SOAK") == marker or (
                proc.create_time() >= since and proc in descendants
            ):
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(found.values())


@pytest.mark.heavy
@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("mode", "policy", "seed"), SOAK_RUNS, ids=[f"{m}-{p}-seed{s}" for m, p, s in SOAK_RUNS]
)
def test_chaos_soak(reference: References, digits_url: str, mode: str, policy: str, seed: int) -> None:
    marker = uuid.uuid4().hex
    # Steps of 4 micro-batches; async mode's faults are `EVERY` batch ids (a quarter of a step) apart.
    steps_wanted = 5 + ROUNDS * len(ROUND) * EVERY["sync"] + 60
    epochs = -(-steps_wanted * 64 // 1797)  # steps of 4 micro-batches of 16 over the 1797 digits
    job = make_job(
        digits_url,
        policy,
        model="tests.models:env_paced_mlp",
        epochs=epochs,
        mode=mode,
        job_id=f"soak-{mode}-{policy}",
    )
    faults = chaos_schedule(seed=seed, rounds=ROUNDS, every=EVERY[mode])
    planned = sum(f.count for f in faults.faults)
    env = {"ELASTIC_TESTS_PACE_S": PACE_S, "ELASTIC_TESTS_SOAK": marker}
    since = time.time()
    with (
        HostNetwork() as net,
        LocalElasticCluster(
            static_workers=3,
            elastic_workers=2,
            env=env,
            host=net.address,
            log_dir=os.environ.get("ELASTIC_SOAK_LOG_DIR"),  # (kept there, to read where a stall went)
        ) as cluster,
    ):
        # Two of the four compute workers run in network namespaces (the partitions' targets), under a
        # supervisor that starts them again if they exit, as systemd or SLURM would.
        names = [cluster.add_worker(netns=net.namespace(), supervise=True, wait=False) for _ in range(2)]
        cluster.wait_for_workers(names)
        try:
            result = train(job, cluster=cluster, faults=faults, on_progress=HoldForFaults(faults, 30))
        finally:
            GATE.unlink(missing_ok=True)
            faults.wait(30)
        running = soak_processes(marker, since)
    left_behind = soak_processes(marker, since)
    figures = soak_figures(result, faults)
    SOAK_FIGURES.append(figures)
    print(figures.summary())
    if os.environ.get("ELASTIC_SOAK_FIGURES"):  # python -m benchmarks.soak collects them for docs/faults.md
        with open(os.environ["ELASTIC_SOAK_FIGURES"], "a") as out:
            out.write(json.dumps(dataclasses.asdict(figures)) + "\n")
    if os.environ.get("ELASTIC_SOAK_STALLS"):  # every stall with its faults and events, to read where it went
        with open(os.environ["ELASTIC_SOAK_STALLS"], "a") as out:
            out.write(f"{mode}, {policy}, seed {seed}:\n")
            out.writelines(f"  {line}\n" for line in stall_lines(result, faults.log))

    if mode == "sync":
        assert_same_parameters(result, reference(job.model_copy(update={"mode": "sync"})))
        assert_ledger_exactly_once(result)
    else:
        # As `check_async`, except that promotions in async mode retract what the promoted shard's snapshot
        # lacks from the ledger (those ids are trained again): every step undone is one of those.
        promoted = sum(e.steps_lost for e in result.events if e.kind == EventKind.PROMOTED)
        assert result.steps_lost == promoted and result.counters["rollbacks"] == 0
        check_async(result, reference(job.model_copy(update={"mode": "sync"})), retracted=promoted)
    ran = Counter(map(fault_label, faults.log))
    assert len(faults.log) == planned >= 50, f"every planned fault ran: {ran}"
    assert figures.processes >= 6, "at least six worker processes took part"
    kinds = set(figures.by_kind)
    assert {"kill", "sigterm", "pause", "restart", "retire", "add", "add-static", "partition"} <= kinds, kinds
    assert figures.promotions >= ROUNDS, "every static kill was taken over by a standby"
    assert len(running) >= 2 * (3 + 2), "the check below sees the cluster's processes while they run"
    assert not left_behind, f"processes left behind: {[(p.pid, p.name()) for p in left_behind]}"
    assert figures.membership_changes >= ROUNDS
