"""A compute worker frozen (SIGSTOP: a hung machine, a stuck read) and woken, for the benchmark suite: the
longest time without a committed step, against the bound survival detection sets."""

from __future__ import annotations

import itertools
import signal
import statistics
import threading
import time
from typing import Any

from prefect_elastic.messages import Progress
from prefect_elastic.training import train

from .elastic import ClusterPool, make_job, next_commit


def longest_gap(commit_times: list[float], after: float) -> tuple[float, float] | None:
    """The longest time without a committed step among the gaps that end after `after`: (seconds, start).

    A gap that starts before `after` counts whole: the time without a commit is the time since the last
    one, whatever happened in between.
    """
    gaps = [(b - a, a) for a, b in itertools.pairwise(commit_times) if b > after]
    return max(gaps) if gaps else None


def frozen(
    pool: ClusterPool,
    workload: str,
    data: str,
    policy: str,
    epochs: int,
    freeze_s: float,
    liveness_interval: float = 1.0,
    settle_steps: int = 20,
) -> dict[str, Any]:
    """Two compute workers; once they trained together for `settle_steps` steps, one is frozen (SIGSTOP to
    its nanny and worker processes: a hung machine, a stuck read) for `freeze_s` s, then woken (SIGCONT)
    while the job goes on; it is woken in any case before this returns.

    The figure is the longest time without a committed step from the freeze on (`longest_gap`), against
    2 liveness intervals plus one step of the worker that trains alone meanwhile (micro_batches=2: alone,
    it computes both micro-batches of a step).
    """
    with pool.elastic(2) as cluster:
        marks: dict[str, float] = {}
        victim: dict[str, str] = {}
        lock = threading.Lock()
        timer: list[threading.Timer] = []
        together_since: int | None = None

        def wake() -> None:
            with lock:
                if "name" not in victim or "cont" in marks:
                    return
                marks["cont"] = time.time()
            cluster.kill_worker(victim["name"], sig=signal.SIGCONT)

        def on_progress(p: Progress) -> None:
            # Runs in the controller's supervision loop: nothing here may block for long.
            nonlocal together_since
            if "stop" in marks:
                return
            if len(p.workers) < 2 or p.state != "running":
                together_since = None
                return
            if together_since is None:
                together_since = p.committed_steps
            if p.committed_steps < together_since + settle_steps:
                return
            address = sorted(p.workers)[0]
            info = cluster.workers_info().get(address)
            if info is None:
                return  # not the scheduler's any more: try again at the next progress
            with lock:
                victim.update(address=address, name=str(info["name"]))
                marks["stop"] = time.time()
                marks["stop_step"] = p.committed_steps
            cluster.kill_worker(victim["name"], sig=signal.SIGSTOP)  # its process group: nanny and worker
            timer.append(threading.Timer(freeze_s, wake))
            timer[0].daemon = True
            timer[0].start()

        job = make_job(
            workload, data, micro_batches=2, epochs=epochs, liveness_interval=liveness_interval,
            policy=policy, job_id=f"frozen-{policy}",
        )  # fmt: skip
        started = time.time()
        try:
            result = train(job, cluster=cluster, on_progress=on_progress)
        finally:
            for t in timer:
                t.cancel()
            wake()  # never leave a stopped worker behind, whatever happened
        wall = time.time() - started
    out: dict[str, Any] = {
        "workload": workload,
        "policy": policy,
        "liveness_interval": liveness_interval,
        "freeze_s": freeze_s,
        "steps": result.steps,
        "wall_s": wall,
        "frozen": "stop" in marks,
    }
    if "stop" not in marks:
        return out
    stop, cont = marks["stop"], marks.get("cont", result.commit_times[-1])
    times = result.commit_times
    before = [b - a for a, b in itertools.pairwise(times) if b <= stop]
    alone = [b - a for a, b in itertools.pairwise(times) if stop < a and b <= cont]
    gap = longest_gap(times, stop)
    left = [e for e in result.membership_events() if e.time > stop and victim["address"] in e.left]
    joined = [e for e in result.membership_events() if e.time > cont and e.joined]
    # One step of the worker that trains alone (the median commit interval while it does), or, if the
    # run had no such steps, twice a step of the two together.
    step_alone = statistics.median(alone[1:] or alone) if alone else 2 * statistics.median(before or [0.0])
    bound = 2 * liveness_interval + step_alone
    out.update(
        {
            "stop_t": stop - started,
            "cont_t": cont - started,
            "stop_step": marks["stop_step"],
            "longest_gap_s": gap[0] if gap else None,
            "longest_gap_at_s": gap[1] - started if gap else None,
            # The gap at the freeze itself: from the last commit before it to the first one after.
            "gap_at_stop_s": next((b - a for a, b in itertools.pairwise(times) if b > stop), None),
            "first_commit_after_stop_s": (nc - stop) if (nc := next_commit(result, stop)) else None,
            "left_after_s": left[0].time - stop if left else None,
            "left_kind": str(left[0].kind) if left else None,
            "steps_lost": [e.steps_lost for e in left],
            "batches_dropped": [e.batches_dropped for e in left],
            "rejoined_after_cont_s": joined[0].time - cont if joined else None,
            "gap_after_cont_s": (g[0] if (g := longest_gap(times, cont)) else None),
            "step_together_s": statistics.median(before) if before else None,
            "step_alone_s": step_alone,
            "bound_s": bound,
            "events": [
                {
                    "kind": str(e.kind),
                    "t": e.time - started,
                    "joined": list(e.joined),
                    "left": list(e.left),
                    "steps_lost": e.steps_lost,
                    "batches_dropped": e.batches_dropped,
                }
                for e in result.membership_events()
            ],
        }
    )
    return out
