"""What a compute loop measured of itself (`LoopStats`): the controller collects one per loop that ended
and sums them into the run's figures (`TrainResult.loops`, docs/benchmarks.md). A step's phases are timed
by a `PhaseClock`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Steps a loop trains before its phases count as steady (`LoopStats.steady_phases`).
WARMUP_STEPS = 5


@dataclass
class LoopStats:
    worker: str
    steps: int = 0
    batches: int = 0
    stale: int = 0
    call_errors: int = 0
    # Of those, calls to a shard that waited out the call timeout (a shard that never answered: frozen, or
    # cut off, and not told of as moved by `leave_links`).
    timeouts: int = 0
    device: str = "cpu"
    # Seconds spent in each phase of the loop, summed over the run (see docs/benchmarks.md).
    phases: dict[str, float] = field(default_factory=dict)
    # The same from the loop's `WARMUP_STEPS + 1`-th step on, and how many steps that is: the first steps
    # of a process are slower (lazy initialization), and a steady-state figure leaves them out.
    steady_phases: dict[str, float] = field(default_factory=dict)
    steady_steps: int = 0
    # Async mode: batch ids trained on a candidate model (the shards' answers were late), and gradients a
    # shard refused as too stale.
    candidate_steps: int = 0
    refused: int = 0
    # Sync mode: micro-batches trained as a backup for a member that did not push them (`stragglers.py`).
    backups: int = 0
    # Sync mode with `overlap_push`: buckets of gradients sent during backward (`bucket_push.py`).
    parts: int = 0
    # ... and with `overlap_pull`: buckets of parameters read during forward (`bucket_pull.py`).
    pulled: int = 0

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        if self.steps >= WARMUP_STEPS:
            self.steady_phases[phase] = self.steady_phases.get(phase, 0.0) + seconds

    def trained(self) -> None:
        if self.steps >= WARMUP_STEPS:
            self.steady_steps += 1
        self.steps += 1


class PhaseClock:
    """The seconds of a step's phases as they end, one after another, into the loop's `stats`."""

    def __init__(self, stats: LoopStats) -> None:
        self.stats = stats
        self._at = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Phase `phase` ends now (it began where the last one ended)."""
        now = time.perf_counter()
        self.stats.add(phase, now - self._at)
        self._at = now
