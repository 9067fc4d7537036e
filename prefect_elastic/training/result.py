"""What a run gives back (`TrainResult`), and what acts on the cluster as it progresses (`FaultInjector`)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..compute import LoopStats
from ..job import ElasticJob
from ..ledger import LedgerEntry
from ..messages import (
    EventKind,
    MembershipEvent,
    Progress,
    Promotion,
)

log = logging.getLogger(__name__)


class FaultInjector(Protocol):
    """Anything that acts on the cluster as training progresses (see `prefect_elastic.local.faults`)."""

    def bind(self, cluster: Any) -> Any: ...

    def apply(self, progress: Progress) -> None: ...


@dataclass
class TrainResult:
    job: ElasticJob
    state_dict: dict[str, torch.Tensor]
    ledger: list[LedgerEntry]
    events: list[MembershipEvent]
    history: list[float]  # mean loss of each committed step
    generation: int
    counters: dict[str, int]
    elapsed: float
    total_steps: int  # of the schedule
    total_batches: int
    loops: list[LoopStats] = field(default_factory=list)
    commit_times: list[float] = field(default_factory=list)  # wall time of each step in `history`
    checkpoint: str | None = None  # the last persistent checkpoint written
    resumed_from: str | None = None  # the checkpoint this run started from
    # Per data server, seconds spent on the step path by phase, summed over the run (`DataServer.phases`):
    # where a step's fixed cost goes on the shards' side.
    shard_phases: list[dict[str, float]] = field(default_factory=list)
    # Lost data servers whose role a standby took, with the time each part of the promotion took.
    promotions: list[Promotion] = field(default_factory=list)
    # Which of the model's tensors each data server held (`plan_shards`; see `ElasticJob.min_shard_bytes`).
    shard_plan: list[list[str]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.history)

    @property
    def steps_lost(self) -> int:
        """Committed steps undone by rollbacks over the whole run."""
        return sum(e.steps_lost for e in self.events)

    @property
    def batches_dropped(self) -> int:
        """Micro-batches of steps in flight that membership changes dropped and re-queued."""
        return sum(e.batches_dropped for e in self.events)

    @property
    def staleness(self) -> dict[int, int]:
        """How many committed batch ids had each staleness (async mode: the most versions any shard had
        moved on between the parameters a gradient was computed on and its apply; all 0 in sync mode)."""
        return dict(sorted(Counter(e.staleness for e in self.ledger).items()))

    @property
    def candidate_steps(self) -> int:
        """Async mode: batch ids a worker trained on a candidate model (its own gradient applied to its
        copy of the parameters, because the shards' answers were late)."""
        return sum(loop.candidate_steps for loop in self.loops)

    def membership_events(self) -> list[MembershipEvent]:
        """The membership changes: the first admission and every rollback or reassign."""
        return [e for e in self.events if e.kind in (EventKind.START, EventKind.ROLLBACK, EventKind.REASSIGN)]
