"""The controller's use of checkpoints in one run: what it resumes from, and when it writes.

A write that fails (a full disk, a folder made read-only) removes its temporary and leaves the folder as it
was: the last checkpoint written stays the newest, and loads. For the run it is a warning and a
`checkpoint-failed` event, not an error: every shard still holds the snapshot in memory (and its peer a
copy), so training goes on and the next checkpoint is tried as usual. More failures in a row than
`ElasticJob.checkpoint_failures_allowed` (`WriteFailures`, the decision) stop training and raise
`CheckpointWriteError`, which holds the state every shard was stopped at, so nothing trained is lost.

Owned by the controller: it decides when to write and what to restore; shards and the coordinator only
export and import their parts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..dataset import explain_storage_error, is_object_store
from ..errors import CheckpointMismatchError, CheckpointWriteError, FatalError
from ..job import CheckpointSpec, StateLayout
from ..messages import EventKind, MembershipEvent, Resume
from ..sharding import Piece, cut, join, plan_pieces
from .cadence import CheckpointCadence
from .optimizer_state import cut_optimizer, join_optimizer
from .record import Checkpoint, check_compatible, fingerprint
from .store import CheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteFailures:
    """The checkpoint writes that failed since the last one that succeeded: the decision whether the job
    goes on (pure; `Persistence` acts on it)."""

    in_a_row: int = 0
    last: str = ""  # what the storage said the last time

    def after(self, error: str | None) -> WriteFailures:
        """The count after one more write: `error` is what failed, None for a write that succeeded."""
        return WriteFailures() if error is None else WriteFailures(self.in_a_row + 1, error)

    def ends_job(self, allowed: int) -> bool:
        """Whether training stops: more writes failed in a row than the job allows
        (`ElasticJob.checkpoint_failures_allowed`)."""
        return self.in_a_row > allowed


@dataclass(frozen=True)
class ShardStart:
    """What one data server starts from: the job's initial values, or a checkpoint's."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    version: int
    applied: tuple[int, ...] = ()  # async mode: the batch ids this shard had applied


class Persistence:
    """The controller's use of checkpoints in one run: what it resumes from and when it writes.

    Opened before any cluster work, so that an unwritable URL or a checkpoint of another job or model
    fails the run at once.
    """

    def __init__(
        self,
        spec: CheckpointSpec,
        layout: StateLayout,
        initial: dict[str, torch.Tensor],
        cadence: CheckpointCadence,
    ) -> None:
        self.spec = spec  # the job's settings the checkpoints are written by
        # `cadence`: how the job's mode turns snapshots into checkpoints (`Mode.checkpoints`).
        self.cadence = cadence
        self.layout = layout
        self.initial = initial
        self.expected = fingerprint(spec, layout, initial)
        self.store = CheckpointStore(spec.url, spec.keep, spec.storage_options) if spec.url else None
        self.resumed: Checkpoint | None = None
        self.resumed_from: str | None = None
        self.last_written: str | None = None
        self.written_step = -1
        # Which pieces of the model each data server holds (`plan_pieces`), set by the controller when it
        # makes the plan: a checkpoint joins the shards' parts into whole tensors by it.
        self.plan: list[list[Piece]] = []
        self._snapshots = 0
        self.failures = WriteFailures()
        # A `checkpoint-failed` event per write that failed, for the run's result (the coordinator records
        # the others; these happen in the controller).
        self.events: list[MembershipEvent] = []
        if self.store is not None:
            self.store.check_writable()
            found = self.store.latest()
            if found is not None:
                checkpoint, where = found
                check_compatible(checkpoint, self.expected, where)
                self.cadence.check_resumable(checkpoint, where)
                self.resumed, self.resumed_from = checkpoint, where
                log.info("job %s resumes from %s at step %d", spec.job_id, where, checkpoint.committed_steps)

    def shard_start(
        self, index: int, held: Sequence[Piece | str], checkpoint: Checkpoint | None = None
    ) -> ShardStart:
        """What data server `index` (holding `held`: its pieces, or names of whole tensors) starts from:
        `checkpoint`, else the checkpoint this run resumed from, else the job's initial values. A checkpoint
        holds whole tensors, so it starts a shard under any plan."""
        checkpoint = checkpoint or self.resumed
        source = checkpoint.tensors if checkpoint else self.initial
        pieces = [
            h if isinstance(h, Piece) else Piece(h, 0, source[h].numel(), source[h].numel()) for h in held
        ]
        tensors = cut(source, pieces)
        params = {n: t for n, t in tensors.items() if n in self.layout.params}
        buffers = {n: t for n, t in tensors.items() if n not in self.layout.params}
        if checkpoint is None:
            return ShardStart(params, buffers, None, 0)
        held_params = [p for p in pieces if p.name in params]
        state = cut_optimizer(self.whole_optimizer(checkpoint), held_params) if held_params else None
        if checkpoint.versions:
            # Async mode: the shard resumes at its own version, with the batch ids it had applied, which
            # hold for the pieces it held then only. (A shard that holds none now is not asked: its
            # pieces went to another, which finds them not its own.)
            written = self.written_plan(checkpoint)
            now = [(p.name, p.start, p.stop) for p in pieces]
            if now and (index >= len(written) or now != written[index]):
                raise CheckpointMismatchError(
                    f"data server {index} would hold other tensors than it held when the async checkpoint "
                    "was written (each shard resumes at a version of its own); resume it with the "
                    "`min_shard_bytes` and `split_tensors` it was written with"
                )
            return ShardStart(
                params, buffers, state, checkpoint.versions[index], checkpoint.applied[index]
            )  # fmt: skip
        return ShardStart(params, buffers, state, checkpoint.committed_steps)

    def written_plan(self, checkpoint: Checkpoint) -> list[list[tuple[str, int, int]]]:
        """Which pieces each shard held when `checkpoint` was written (name, first element, end)."""
        if checkpoint.plan:
            return [list(pieces) for pieces in checkpoint.plan]
        return [[(p.name, p.start, p.stop) for p in pieces] for pieces in self._legacy_plan(checkpoint)]

    def _legacy_plan(self, checkpoint: Checkpoint) -> list[list[Piece]]:
        # Formats 1 and 2: whole tensors, as `data_servers` and `min_shard_bytes` dealt them (the
        # checkpoint's fingerprint names both).
        job = checkpoint.fingerprint.get("job", {})
        ours = self.spec.fingerprint_fields
        shards = int(job.get("data_servers", ours.get("data_servers", len(checkpoint.optimizers))))
        floor = int(job.get("min_shard_bytes", self.spec.min_shard_bytes))
        written = plan_pieces(checkpoint.tensors, shards, floor, split=False)
        if checkpoint.optimizers and len(written) != len(checkpoint.optimizers):
            written = plan_pieces(checkpoint.tensors, len(checkpoint.optimizers), floor, split=False)
        return written

    def whole_optimizer(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """The checkpoint's optimizer state by tensor name; a checkpoint of format 1 or 2 holds one state
        per shard, under the whole-tensor plan of the `data_servers` and `min_shard_bytes` it was written
        with (its fingerprint names them)."""
        if checkpoint.optimizer is not None:
            return checkpoint.optimizer
        written = self._legacy_plan(checkpoint)
        return join_optimizer(checkpoint.optimizers, written, self._param_shapes(checkpoint.tensors))

    def _param_shapes(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
        return {n: t.shape for n, t in tensors.items() if n in self.layout.params}

    def fallback(self) -> tuple[Checkpoint | None, str] | None:
        """Where every shard goes back to when a data server is lost with the replica of its shard: the
        newest checkpoint in the store (this run's last, or the one it resumed from) and its URL, or
        `(None, "the start")` when none was written yet (the state the run started from). None for a job
        without `checkpoint`: it has nothing to go back to but the start, and redoing a whole run is not
        done without asking."""
        if self.store is None:
            return None
        found = self.store.latest()
        if found is None:
            return (self.resumed, self.resumed_from or "the start")
        checkpoint, where = found
        check_compatible(checkpoint, self.expected, where)
        return checkpoint, where

    def resume(self) -> Resume | None:
        if self.resumed is None:
            return None
        r = self.resumed
        return Resume(r.generation, r.committed_steps, r.ledger, r.history, r.versions, r.applied)

    def after_snapshot(
        self,
        coordinator: Any,
        shards: list[Any],
        timeout: float,
        on_event: Callable[[MembershipEvent], None] | None = None,
    ) -> str | None:
        """Count a snapshot; every `checkpoint_every`-th is written. A write that fails is a warning and a
        `checkpoint-failed` event (also given to `on_event`); more in a row than the job allows stop
        training and raise `CheckpointWriteError`."""
        self._snapshots += 1
        every = self.cadence.snapshots_per_checkpoint(self.spec.every)
        if self.store is None or self._snapshots % every:
            return None
        failed = len(self.events)
        written = self.write(coordinator, shards, timeout)
        if on_event is not None:
            for event in self.events[failed:]:
                on_event(event)
        if self.failures.ends_job(self.spec.failures_allowed):
            raise self._give_up(coordinator, shards, timeout)
        return written

    def write(self, coordinator: Any, shards: list[Any], timeout: float) -> str | None:
        """Write the last snapshot every shard holds (shards keep it until the controller's next survival
        check asks for a newer one, so nothing replaces it while this reads). Returns the last checkpoint
        written; one the storage refuses is counted in `failures` and recorded in `events`, not raised
        (the shards still hold the snapshot)."""
        if self.store is None:
            return None
        record: Resume = coordinator.snapshot_record().result(timeout=timeout)
        if self.written_step == record.committed_steps:
            return self.last_written
        checkpoint = self._gather(record, shards, timeout)
        began = time.time()
        try:
            written = self.store.write(checkpoint)
        except Exception as exc:
            self._failed(checkpoint, exc, began)
            return self.last_written
        self.last_written, self.written_step = written, checkpoint.committed_steps
        self.failures = self.failures.after(None)
        return written

    def _gather(self, record: Resume, shards: list[Any], timeout: float) -> Checkpoint:
        """The last snapshot every shard holds (`record`: the coordinator's part of it) as one checkpoint."""
        # Async mode: each shard has a version of its own (`record.versions`); sync: the ledger's.
        versions = list(record.versions) or [record.committed_steps] * len(shards)
        asked = [s.export_snapshot(v) for s, v in zip(shards, versions, strict=True)]
        parts = [f.result(timeout=timeout) for f in asked]
        if [p["version"] for p in parts] != versions:
            raise FatalError(
                f"snapshot versions {[p['version'] for p in parts]} differ from the ledger's "
                f"{versions}; no checkpoint written"
            )
        plan = self.plan or [
            [Piece(n, 0, t.numel(), t.numel()) for n, t in p["tensors"].items()] for p in parts
        ]
        shapes = {n: t.shape for n, t in self.initial.items()}
        # Whole tensors, a plain state_dict, whichever shards held which parts of them.
        tensors = join([p["tensors"] for p in parts], plan, shapes)
        return Checkpoint(
            job_id=self.spec.job_id,
            fingerprint=self.expected,
            generation=record.generation,
            committed_steps=record.committed_steps,
            ledger=record.ledger,
            history=record.history,
            tensors=tensors,
            optimizers=[],
            versions=tuple(record.versions),
            applied=tuple(tuple(p["applied"]) for p in parts) if record.versions else (),
            optimizer=join_optimizer([p["optimizer"] for p in parts], plan, self._param_shapes(self.initial)),
            plan=tuple(tuple((p.name, p.start, p.stop) for p in pieces) for pieces in plan),
        )

    def _last_good(self) -> str | None:
        """The newest checkpoint in the folder as this run knows it: its last write, or its resume's."""
        return self.last_written or self.resumed_from

    def _failed(self, checkpoint: Checkpoint, exc: Exception, began: float) -> None:
        """Count a write the storage refused; warn, and record it as an event."""
        assert self.store is not None
        # (Its advice is about storage servers: credentials, endpoints. A local folder's error says enough.)
        store = self.store
        what = (
            explain_storage_error(exc, store.storage_options)
            if is_object_store(store.fs)
            else f"{type(exc).__name__}: {exc}"
        )
        self.failures = self.failures.after(what)
        allowed = self.spec.failures_allowed
        then = (
            "training stops"
            if self.failures.ends_job(allowed)
            else "training goes on from the snapshot every shard holds in memory, and the next checkpoint "
            "tries again"
        )
        last = self._last_good()
        reason = (
            f"the checkpoint of step {checkpoint.committed_steps} could not be written to {self.store.url} "
            f"({what}); {then} ({self.failures.in_a_row} failed in a row, checkpoint_failures_allowed="
            f"{allowed}); the last checkpoint written is {last or 'none yet'}"
        )
        log.warning("job %s: %s", self.spec.job_id, reason)
        self.events.append(
            MembershipEvent(
                time=began,
                kind=EventKind.CHECKPOINT_FAILED,
                generation=checkpoint.generation,
                step=checkpoint.committed_steps,
                workers=(),
                reason=reason,
                seconds=time.time() - began,
            )
        )

    def _give_up(self, coordinator: Any, shards: list[Any], timeout: float) -> CheckpointWriteError:
        """Stop training (every shard brought to one version and snapshotted, as a stop does) and return
        the error that ends the job, holding that snapshot: the parameters every shard held, not lost."""
        assert self.store is not None
        failures, allowed, url = self.failures, self.spec.failures_allowed, self.store.url
        coordinator.stop(f"{failures.in_a_row} checkpoint writes in a row failed").result(timeout=3 * timeout)
        final = self._gather(coordinator.snapshot_record().result(timeout=timeout), shards, timeout)
        step, last = final.committed_steps, self._last_good()
        written = f"the last checkpoint written is {last}" if last else f"{url} holds none of this job"
        return CheckpointWriteError(
            f"job {self.spec.job_id}: {failures.in_a_row} checkpoint writes in a row to {url} failed (more "
            f"than checkpoint_failures_allowed={allowed}), the last with {failures.last}; training stopped "
            f"at step {step}, and {written}. The final parameters (step {step}) are not lost: this error "
            "holds them, as `state_dict` and as a whole checkpoint, `final`. Free space in the folder or "
            "make it writable again (or point `checkpoint` at another folder), write them there with "
            "`CheckpointStore(url).write(error.final)`, and run the job again: it resumes at step "
            f"{step}",
            checkpoint=last,
            final=final,
            state_dict=self.layout.export(final.tensors),
            step=step,
        )
