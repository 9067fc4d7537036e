"""The batch ledger: which batch ids are committed, by which step and generation.

In async mode every batch id is a step of its own, and steps are numbered in the order the ledger
committed them (every shard applied the batch id), not by batch id.

Owned by the coordinator; nothing else writes it. A batch id is committed once, when the step that trains
it has been applied on every shard, so the ledger always agrees with the parameter version: the
parameters at version `v` are the result of steps `0..v-1`, and those are exactly the committed steps.
A rollback drops what was committed after the last snapshot, which keeps that agreement.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import FatalError


@dataclass(frozen=True)
class LedgerEntry:
    batch_id: int
    step: int
    generation: int
    worker: str = ""  # the compute worker whose gradient was applied
    # Async mode: the most versions any shard had moved on between the parameters the gradient was
    # computed on and its apply (0 in sync mode, where every gradient is of the version it is applied to).
    staleness: int = 0


class Ledger:
    def __init__(self) -> None:
        self._entries: dict[int, LedgerEntry] = {}
        self._steps: list[list[int]] = []  # the batch ids of each committed step, in step order
        self.committed_steps = 0  # == the parameter version
        self.snapshot_step = 0  # steps < snapshot_step are held by the shards' last snapshot
        self.dropped_batches = 0  # committed, then dropped by a rollback
        self.dropped_steps = 0

    def commit(
        self,
        batch_ids: Iterable[int],
        step: int,
        generation: int,
        workers: dict[int, str] | None = None,
        staleness: int = 0,
    ) -> None:
        if step != self.committed_steps:
            raise FatalError(f"ledger: step {step} committed out of order (next is {self.committed_steps})")
        ids = list(batch_ids)
        twice = [b for b in ids if b in self._entries]
        if twice:
            # Exactly-once is the invariant the whole system exists for; a breach is a bug, never ignored.
            raise FatalError(f"ledger: batch ids {twice} committed twice (step {step})")
        for b in ids:
            worker = (workers or {}).get(b, "")
            self._entries[b] = LedgerEntry(b, step, generation, worker, staleness)
        self._steps.append(ids)
        self.committed_steps += 1

    def restore(self, entries: Iterable[LedgerEntry], committed_steps: int) -> None:
        """Start from a checkpoint: its entries are committed and part of the snapshot."""
        self._entries = {e.batch_id: e for e in entries}
        if {e.step for e in self._entries.values()} != set(range(committed_steps)):
            raise FatalError(
                f"ledger of the checkpoint does not cover steps 0..{committed_steps - 1} exactly"
            )
        self._steps = [[] for _ in range(committed_steps)]
        for e in sorted(self._entries.values(), key=lambda e: e.batch_id):
            self._steps[e.step].append(e.batch_id)
        self.committed_steps = self.snapshot_step = committed_steps

    def mark_snapshot(self, step: int | None = None) -> None:
        """The shards' snapshot now holds steps `0..step-1` (all committed steps when `step` is None)."""
        step = self.committed_steps if step is None else step
        if not self.snapshot_step <= step <= self.committed_steps:
            raise FatalError(
                f"ledger: snapshot of step {step} outside {self.snapshot_step}..{self.committed_steps}"
            )
        self.snapshot_step = step

    def drop_after_snapshot(self) -> list[int]:
        """Forget the steps committed after the last snapshot; returns the dropped batch ids."""
        dropped = sorted(b for b, e in self._entries.items() if e.step >= self.snapshot_step)
        for b in dropped:
            del self._entries[b]
        del self._steps[self.snapshot_step :]
        self.dropped_steps += self.committed_steps - self.snapshot_step
        self.dropped_batches += len(dropped)
        self.committed_steps = self.snapshot_step
        return dropped

    def entries(self) -> list[LedgerEntry]:
        return sorted(self._entries.values(), key=lambda e: e.batch_id)

    def entries_from(self, step: int) -> list[LedgerEntry]:
        """The entries of steps `step` and after, in step order (costs what they hold, not the ledger)."""
        return [self._entries[b] for ids in self._steps[step:] for b in ids]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._entries
