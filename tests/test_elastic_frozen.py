"""A frozen worker (SIGSTOP) on real processes: out of the membership once its heartbeats stop, or, while
survival detection does not act on it yet, its steps finished by the others; woken, its stale messages
refused. Invariants 1 and 2 hold throughout."""

from __future__ import annotations

import itertools
import signal
import time

import pytest

from prefect_elastic import TrainResult, train
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.messages import EventKind, Progress

from .conftest import References, assert_ledger_exactly_once, assert_same_parameters, make_job, top_up
from .models import GATE
from .test_elastic import lost_workers

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def silent_steps(result: TrainResult, worker: str) -> range:
    """The steps between the last one `worker` pushed to before it froze and the next one it pushed to.

    The step it froze in is read from the ledger, not from the fault's record: that record holds the
    coordinator's count of committed steps, and the shards can run a step or more ahead of it."""
    steps = sorted({e.step for e in result.ledger if e.worker == worker})
    froze_in = next((a for a, b in itertools.pairwise(steps) if b > a + 1), steps[-1])
    assert steps[: steps.index(froze_in) + 1] == list(range(froze_in + 1)), "it trained every step until then"
    back = next((b for b in steps if b > froze_in), result.total_steps)
    return range(froze_in + 1, back)


def test_frozen_worker_leaves_the_membership_and_its_stale_messages_are_refused(
    cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """Invariant 4: a SIGSTOPped worker stays in the scheduler for minutes (worker-ttl), but it stops
    sending heartbeats, so it leaves the membership and training goes on without it. Woken, it finishes
    the step it was in: its push, of an old generation, is refused, and it joins again as a new member."""
    top_up(cluster, 2)
    job = make_job(
        digits_url, "reassign", model="tests.models:gated_slow_mlp", liveness_interval=1.0, job_id="frozen"
    )
    faults = FaultSchedule(seed=8).freeze_worker(at_step=6)
    seen: dict[str, float] = {}

    def freeze_mid_step(p: Progress) -> None:
        # From step 6 the model waits in its forward pass until the freeze is recorded: the frozen worker
        # is then in the middle of its share of a step.
        if p.committed_steps >= 6 and not faults.log:
            GATE.touch()
            return
        if not faults.log:
            GATE.unlink(missing_ok=True)
            return
        frozen = faults.log[0].target
        seen.setdefault("frozen", faults.log[0].time)
        if frozen not in p.workers and "left" not in seen:
            seen["left"] = time.time()
            cluster.kill_worker(frozen, sig=signal.SIGCONT)  # wake it while the others train
        if "left" in seen and frozen in p.workers:
            seen.setdefault("back", time.time())
        # Training goes on until it left; once woken, it waits (at the gate) for the worker to be a
        # member again, so the job cannot end before it rejoins, however long that takes.
        if "left" not in seen or "back" in seen or p.committed_steps < 30:
            GATE.unlink(missing_ok=True)
        else:
            GATE.touch()

    try:
        result = train(job, cluster=cluster, faults=faults, on_progress=freeze_mid_step)
    finally:
        GATE.unlink(missing_ok=True)
        faults.thaw()
    assert [r.kind for r in faults.log] == ["freeze"]
    frozen = faults.log[0].target
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert frozen in lost_workers(result), "out of the membership while the scheduler still listed it"
    (left,) = [e for e in result.membership_events() if frozen in e.left]
    assert left.step >= faults.log[0].step and left.kind == EventKind.REASSIGN
    print(f"frozen worker out of the membership {left.time - seen['frozen']:.2f} s after the SIGSTOP")
    assert result.counters["stale_messages"] >= 1, "its push of an old generation was refused"
    assert [e for e in result.membership_events() if frozen in e.joined and e.time > left.time], (
        "woken, it joined again"
    )
    # It froze in the step the fault recorded or (the shards ahead of the coordinator) a later one. The
    # steps after it, until it left, were trained by the others from backups of its share: what it pushed
    # on waking was refused, and it pushed again only as a new member.
    silent = silent_steps(result, frozen)
    assert silent.start >= faults.log[0].step and silent, "the others trained on while it was frozen"
    assert silent.stop >= left.step, "no push of its old membership was taken"


def test_a_frozen_members_steps_are_finished_by_the_others_and_woken_it_trains_beside_them_again(
    cluster: LocalElasticCluster, reference: References, digits_url: str
) -> None:
    """A SIGSTOPped member whose silence survival detection does not act on yet (a liveness interval
    longer than the run) holds no step up: the shards ask the members that pushed for its micro-batches
    (a backup, `stragglers.py`), and the steps commit without it, bit for bit. Woken, its push of the step
    it froze in is refused (the shards went past it), it goes on beside the others, and no batch id is
    committed twice. No membership change at all."""
    top_up(cluster, 3)
    job = make_job(
        digits_url,
        "rollback",
        model="tests.models:gated_slow_mlp",
        liveness_interval=600.0,
        epochs=3,
        job_id="backup",
    )
    faults = FaultSchedule(seed=8).freeze_worker(at_step=6)
    seen: dict[str, int] = {}

    def freeze_then_wake(p: Progress) -> None:
        # From step 6 the model waits in its forward pass until the freeze is recorded: the frozen worker
        # is then in the middle of its share of a step.
        if p.committed_steps >= 6 and not faults.log:
            GATE.touch()
            return
        GATE.unlink(missing_ok=True)
        if faults.log and "woken" not in seen:
            seen.setdefault("frozen", p.committed_steps)
            if p.committed_steps >= seen["frozen"] + 10:  # ten steps committed without it: wake it
                seen["woken"] = p.committed_steps
                cluster.kill_worker(faults.log[0].target, sig=signal.SIGCONT)

    try:
        result = train(job, cluster=cluster, faults=faults, on_progress=freeze_then_wake)
    finally:
        GATE.unlink(missing_ok=True)
        faults.thaw()
    assert [r.kind for r in faults.log] == ["freeze"] and "woken" in seen
    frozen = faults.log[0].target
    assert_same_parameters(result, reference(job))
    assert_ledger_exactly_once(result)
    assert [e.kind for e in result.membership_events()] == [EventKind.START], "it never left"
    assert result.steps_lost == 0
    # Its share of every step committed while it was frozen was trained by the others. The step it froze in
    # is read from the ledger: the shards can be a step or more ahead of the coordinator's count.
    (start,) = result.membership_events()
    rank = start.workers.index(frozen)
    while_frozen = silent_steps(result, frozen)
    assert while_frozen.start >= faults.log[0].step and while_frozen, while_frozen
    backed_up = [
        e for e in result.ledger if e.step in while_frozen and e.batch_id % job.micro_batches % 3 == rank
    ]
    assert backed_up and all(e.worker not in ("", frozen) for e in backed_up), backed_up
    assert sum(loop.backups for loop in result.loops) >= len(backed_up)
    assert [e for e in result.ledger if e.worker == frozen and e.step > seen["woken"]], "it trains again"
