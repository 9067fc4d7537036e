"""A chaos soak: many faults of every kind in one training run, and the figures that say how it went.

    from prefect_elastic.local.chaos import chaos_schedule, soak_figures

    faults = chaos_schedule(seed=1, rounds=6, every=25)
    result = train(job, cluster=local_cluster, faults=faults)
    print(soak_figures(result, faults).summary())

A round is one fault of each kind (`ROUND`), in an order the seed shuffles: a SIGKILL, a SIGTERM (a
graceful leave), a pause (SIGSTOP, then SIGCONT seconds later), a nanny restart, a graceful retire, a
join, a group of joins, a static worker's SIGKILL with a new static worker started at the same step
(the next standby), and a network partition of a compute worker that runs in a network namespace (its
link cut, healed seconds later; `partitions=False` leaves it out, for a cluster without namespaces).
The static kills alternate between data server 1 and the coordinator, in either mode (docs/design/async.md:
async mode rebuilds a lost coordinator too). The order keeps the compute workers the schedule counts alive
within bounds, so that a kill always finds a target and the cluster does not outgrow the machine.

`soak_figures` is pure: what the soak survived (faults by kind, worker processes that took part) and
what it cost (steps undone, the time the committed steps stood still, the longest stall).
"""

from __future__ import annotations

import itertools
import random
import signal
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from ..messages import EventKind
from ..training import TrainResult
from .faults import FaultRecord, FaultSchedule

Action = Literal["kill", "sigterm", "pause", "restart", "retire", "add", "group", "static", "partition"]

ROUND: tuple[Action, ...] = (
    "kill", "sigterm", "pause", "restart", "retire", "add", "group", "static", "partition",
)  # fmt: skip
# How each action changes the count of live compute workers.
_ALIVE_CHANGE: dict[Action, int] = {"kill": -1, "sigterm": -1, "retire": -1, "add": 1, "group": 2}
GROUP = 2  # workers started together in a group of joins


def plan_rounds(
    seed: int,
    rounds: int,
    *,
    start_alive: int,
    min_alive: int = 2,
    max_alive: int = 6,
    kinds: tuple[Action, ...] = ROUND,
) -> list[Action]:
    """`rounds` rounds of `kinds`, each shuffled by the seed until the live compute workers, counted from
    `start_alive`, stay within [min_alive, max_alive] before and after every action."""
    if not min_alive <= start_alive <= max_alive:
        raise ValueError(
            f"start_alive={start_alive} must lie within min_alive={min_alive} and max_alive={max_alive}"
        )
    if max_alive - min_alive < GROUP + 1:
        raise ValueError(f"max_alive - min_alive must be at least {GROUP + 1} to fit a group of joins")
    rng = random.Random(seed)
    plan: list[Action] = []
    alive = start_alive
    for _ in range(rounds):
        for _attempt in range(1000):
            order = list(kinds)
            rng.shuffle(order)
            counts = _running_counts(alive, order)
            if min(counts) >= min_alive and max(counts) <= max_alive:
                break
        else:  # pragma: no cover - the bounds checked above always leave an order that fits
            raise RuntimeError("no order of a round keeps the live compute workers within bounds")
        plan += order
        alive = counts[-1]
    return plan


def _running_counts(alive: int, order: list[Action]) -> list[int]:
    counts = [alive]
    for action in order:
        counts.append(counts[-1] + _ALIVE_CHANGE.get(action, 0))
    return counts


def chaos_schedule(
    seed: int,
    rounds: int,
    every: int,
    *,
    first_step: int = 5,
    start_alive: int = 4,
    pause_seconds: tuple[float, float] = (0.4, 2.5),
    partitions: bool = True,
    cut_seconds: tuple[float, float] = (2.0, 5.0),
) -> FaultSchedule:
    """A `FaultSchedule` of `rounds` rounds (`plan_rounds`), one action every `every` committed steps
    from `first_step` on. A pause lasts a seeded time within `pause_seconds`: shorter than two liveness
    intervals, the worker is a straggler for a moment; longer, it leaves the membership and joins again. A
    partition lasts a seeded time within `cut_seconds` (shorter than Dask's TCP timeout, so the same
    process joins again once healed)."""
    if every < 1 or rounds < 1:
        raise ValueError(f"rounds={rounds} and every={every} must be at least 1")
    rng = random.Random(seed + 1)
    schedule = FaultSchedule(seed=seed)
    static_kills = 0
    kinds = ROUND if partitions else tuple(k for k in ROUND if k != "partition")
    for i, action in enumerate(plan_rounds(seed, rounds, start_alive=start_alive, kinds=kinds)):
        at = first_step + i * every
        if action == "kill":
            schedule.kill_worker(at)
        elif action == "sigterm":
            schedule.kill_worker(at, sig=signal.SIGTERM)
        elif action == "pause":
            schedule.pause_worker(at, round(rng.uniform(*pause_seconds), 2))
        elif action == "restart":
            schedule.restart_worker(at)
        elif action == "retire":
            schedule.retire_worker(at)
        elif action == "add":
            schedule.add_worker(at)
        elif action == "group":
            schedule.add_worker(at, count=GROUP)
        elif action == "partition":
            schedule.partition_worker(at, heal_after=round(rng.uniform(*cut_seconds), 2))
        else:
            if static_kills % 2 == 1:
                schedule.kill_coordinator(at)
            else:
                schedule.kill_data_server(at, 1)
            schedule.add_static_worker(at)
            static_kills += 1
    return schedule


@dataclass(frozen=True)
class SoakFigures:
    """What one soak run survived and what it cost."""

    mode: str
    policy: str
    faults: int  # processes acted on (a group of joins counts each worker)
    by_kind: dict[str, int]
    processes: int  # worker processes that took part: compute members and the static workers acted on
    steps: int
    membership_changes: int  # rollbacks and reassigns
    promotions: int  # lost static roles taken over by a standby (data servers and the coordinator)
    steps_lost: int  # committed steps undone by rollbacks
    longest_stall: float  # the longest gap between two commits, seconds
    elapsed: float
    stalls: list[float] = field(
        default_factory=list
    )  # gaps between commits longer than the liveness interval
    # The longest stalls, each with the faults and the events of survival detection within it.
    worst: list[str] = field(default_factory=list)
    # The seconds without a commit by what the stall held (`stall_causes`).
    causes: dict[str, float] = field(default_factory=dict)
    # Each promotion's seconds from the loss seen to the standby's role in place, by part ("suspend",
    # "start", "adopt", "promote": `messages.Promotion`).
    promotion_parts: list[dict[str, float]] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        """The share of the run's time in which committed steps went on (no stall)."""
        return 1.0 - self.stalled_seconds / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def stalled_seconds(self) -> float:
        """The time the committed steps stood still: the stalls together."""
        return sum(self.stalls)

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.by_kind.items()))
        return (
            f"chaos soak ({self.mode}, {self.policy}): {self.faults} faults survived ({kinds}) over "
            f"{self.processes} worker processes; {self.steps} steps in {self.elapsed:.1f} s; "
            f"{self.membership_changes} membership changes, {self.promotions} promotions, "
            f"{self.steps_lost} steps undone; {self.stalled_seconds:.1f} s without a commit in "
            f"{len(self.stalls)} stalls, the longest {self.longest_stall:.2f} s; goodput {self.goodput:.2f} ("
            + ", ".join(f"{cause} {seconds:.1f} s" for cause, seconds in self.causes.items())
            + ")"
            + "".join(
                f"\n  promotion {sum(parts.values()):.2f} s ("
                + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                + ")"
                for parts in self.promotion_parts
            )
            + "".join(f"\n  stall {w}" for w in self.worst)
        )


def commit_gaps(commit_times: list[float]) -> list[float]:
    """Seconds between consecutive commits of the steps the run ended with."""
    return [b - a for a, b in itertools.pairwise(commit_times)]


def fault_label(record: FaultRecord) -> str:
    """What a fault was, for the figures: the kind, told apart by signal and by static role."""
    if record.kind == "kill" and record.role is not None:
        return f"kill {record.role}"
    if record.kind == "kill" and record.sig == signal.SIGTERM:
        return "sigterm"
    return record.kind


def worst_stalls(result: TrainResult, log: list[FaultRecord], top: int = 3) -> list[str]:
    """The `top` longest gaps between commits, each with what happened within it: the faults (by the
    schedule's log) and then what survival detection did (by `result.events`), in time order, each with
    its seconds into the gap."""
    times = result.commit_times
    gaps = sorted(range(len(times) - 1), key=lambda i: times[i + 1] - times[i], reverse=True)[:top]
    described = []
    for i in sorted(gaps, key=lambda i: times[i]):
        begin, end = times[i], times[i + 1]
        faults = [f"{fault_label(r)} +{r.time - begin:.2f}" for r in log if begin <= r.time <= end]
        events = [
            f"{e.kind} +{e.time - begin:.2f}"
            for e in result.events
            if begin <= e.time <= end and e.kind != EventKind.SNAPSHOT
        ]
        described.append(
            f"{end - begin:.2f} s after step {i + 1}: faults [{', '.join(faults)}], "
            f"then [{', '.join(events)}]"
        )
    return described


# What a stall held, from the events within it, the first that applies: a static role that moved (or was
# asked and kept), a moment with no compute member, steps undone by a rollback, a step dropped by a reassign.
STALL_CAUSES: tuple[tuple[str, tuple[EventKind, ...]], ...] = (
    (
        "static role",
        (EventKind.SHARD_LOST, EventKind.PROMOTED, EventKind.KEPT, EventKind.COORDINATOR_REBUILT),
    ),
    ("no member", (EventKind.WAITING,)),
    ("rollback", (EventKind.ROLLBACK,)),
    ("reassign", (EventKind.REASSIGN,)),
)


def stall_causes(result: TrainResult, stall_after: float) -> dict[str, float]:
    """The seconds of the gaps between commits longer than `stall_after`, by what each held
    (`STALL_CAUSES`; "other" where no event of survival detection came within it: a straggler, a pause
    shorter than the silence limit, the soak holding training for its last faults). Pure."""
    causes = dict.fromkeys([name for name, _ in STALL_CAUSES] + ["other"], 0.0)
    times = result.commit_times
    for begin, end in itertools.pairwise(times):
        if end - begin <= stall_after:
            continue
        kinds = {e.kind for e in result.events if begin <= e.time <= end}
        cause = next((name for name, held in STALL_CAUSES if kinds & set(held)), "other")
        causes[cause] += end - begin
    return causes


def soak_figures(result: TrainResult, faults: FaultSchedule) -> SoakFigures:
    """The figures of a soak run from its result and the schedule's log (pure)."""
    gaps = commit_gaps(result.commit_times)
    stalls = [g for g in gaps if g > result.job.liveness_interval]
    by_kind: Counter[str] = Counter()
    for record in faults.log:
        by_kind[fault_label(record)] += 1
    members = {w for e in result.membership_events() for w in e.workers + e.left + e.joined}
    static = {r.target for r in faults.log if r.kind in ("kill", "add-static")} - members
    changes = [e for e in result.events if e.kind in (EventKind.ROLLBACK, EventKind.REASSIGN)]
    promoted = [e for e in result.events if e.kind in (EventKind.PROMOTED, EventKind.COORDINATOR_REBUILT)]
    return SoakFigures(
        mode=result.job.mode,
        policy=result.job.on_membership_change,
        faults=len(faults.log),
        by_kind=dict(by_kind),
        processes=len(members | static),
        steps=len(result.history),
        membership_changes=len(changes),
        promotions=len(promoted),
        steps_lost=result.steps_lost,
        longest_stall=max(gaps, default=0.0),
        elapsed=result.elapsed,
        stalls=stalls,
        worst=worst_stalls(result, faults.log),
        causes=stall_causes(result, result.job.liveness_interval),
        promotion_parts=[
            {"suspend": p.suspend, "start": p.start, "adopt": p.adopt, "promote": p.promote}
            for p in result.promotions
        ],
    )
