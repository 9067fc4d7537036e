"""Persistent checkpoints on any fsspec URL: what makes "loses nothing" true for the whole job.

A checkpoint is one file holding the parameters, buffers and optimizer state of every shard as of one
snapshot, the ledger up to that snapshot, the loss history, the generation, and a fingerprint of the job
and the model. It is written with `torch.save` and read with `torch.load(weights_only=True)` (tensors,
numbers, strings, lists and dicts only: never plain pickle).

Writes are atomic for a reader: the bytes go to a temporary name (`.tmp-<random>.pt`) that no reader looks
at, then move to the final name (`ckpt-<step>.pt`). On a file system the move is a rename, atomic by POSIX.
On an object store (S3, GCS, ...) there is no rename: the move is a server-side copy to the final key and a
delete of the temporary one; the store creates an object only when its bytes are complete (one PUT, or a
multipart upload's completion, or a copy), so a reader of the final key gets all of the checkpoint or no
object at all, never part of one. A writer that dies between upload and move leaves a temporary object,
which readers ignore and the next prune removes. Readers only consider final names, newest first, and list
the folder afresh each time (another process may have written since). Old checkpoints are pruned to `keep`.
docs/storage.md says the same for users.

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

import hashlib
import io
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from .dataset import explain_storage_error, is_object_store
from .errors import CheckpointMismatchError, CheckpointWriteError, FatalError, JobConfigError
from .job import ElasticJob, StateLayout
from .ledger import LedgerEntry
from .messages import EventKind, MembershipEvent, Resume

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the ledger has a 4th column, async mode's staleness; format 1 (3 columns) is still read
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_TEMPORARY = re.compile(r"^\.tmp-[0-9a-f]{32}\.pt$")


@dataclass(frozen=True)
class Checkpoint:
    job_id: str
    fingerprint: dict[str, Any]  # job fields and model layout; see `fingerprint`
    generation: int
    committed_steps: int
    ledger: list[LedgerEntry]
    history: list[float]
    tensors: dict[str, torch.Tensor]  # parameters and buffers, each once (see StateLayout)
    optimizers: list[dict[str, Any]]  # one optimizer state_dict per shard
    # Async mode: each shard's version, and the batch ids it had applied (sync: every shard is at
    # `committed_steps`, and the ledger says what was applied).
    versions: tuple[int, ...] = ()
    applied: tuple[tuple[int, ...], ...] = ()

    def to_bytes(self) -> bytes:
        payload = {
            "format": FORMAT,
            "job_id": self.job_id,
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True),
            "generation": self.generation,
            "committed_steps": self.committed_steps,
            "ledger": torch.tensor(
                [[e.batch_id, e.step, e.generation, e.staleness] for e in self.ledger], dtype=torch.int64
            ).reshape(-1, 4),
            "ledger_workers": [e.worker for e in self.ledger],
            "history": torch.tensor(self.history, dtype=torch.float64),
            "tensors": self.tensors,
            "optimizers": self.optimizers,
        }
        if self.versions:
            payload["versions"] = torch.tensor(self.versions, dtype=torch.int64)
            payload["applied"] = [torch.tensor(ids, dtype=torch.int64) for ids in self.applied]
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Checkpoint:
        try:
            payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            if payload.get("format") not in (1, FORMAT):
                raise ValueError(f"format {payload.get('format')!r}, expected {FORMAT}")
            rows = payload["ledger"].tolist()
            workers = payload["ledger_workers"]
            return cls(
                job_id=payload["job_id"],
                fingerprint=json.loads(payload["fingerprint"]),
                generation=int(payload["generation"]),
                committed_steps=int(payload["committed_steps"]),
                # (A ledger of 3 columns was written before async mode's staleness was kept: 0 there.)
                ledger=[
                    LedgerEntry(b, s, g, w, *rest) for (b, s, g, *rest), w in zip(rows, workers, strict=True)
                ],
                history=[float(v) for v in payload["history"].tolist()],
                tensors=dict(payload["tensors"]),
                optimizers=list(payload["optimizers"]),
                versions=tuple(int(v) for v in payload.get("versions", torch.zeros(0)).tolist()),
                applied=tuple(tuple(int(b) for b in t.tolist()) for t in payload.get("applied", [])),
            )
        except Exception as exc:
            raise FatalError(
                f"checkpoint {where} cannot be read ({type(exc).__name__}: {exc}); it is not a "
                "prefect-elastic checkpoint of this version, or it was damaged; move it away to start afresh"
            ) from exc


def fingerprint(job: ElasticJob, layout: StateLayout, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a checkpoint must agree on to resume a job: the job fields that decide the result, and the
    model's tensors (names, shapes, dtypes)."""
    model = {n: [list(t.shape), str(t.dtype)] for n, t in tensors.items()}
    return {
        "job": json.loads(json.dumps(job.fingerprint_fields(), sort_keys=True, default=str)),
        "model": model,
        "model_digest": hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:16],
        "aliases": dict(sorted(layout.aliases.items())),
    }


def check_compatible(found: Checkpoint, expected: dict[str, Any], where: str) -> None:
    if found.fingerprint.get("model") != expected["model"]:
        theirs, ours = found.fingerprint.get("model", {}), expected["model"]
        differ = sorted(set(theirs) ^ set(ours)) or sorted(k for k in ours if theirs.get(k) != ours[k])
        raise CheckpointMismatchError(
            f"checkpoint {where} holds another model: its tensors differ from this job's model in "
            f"{', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}; point `checkpoint` at another "
            "folder, or remove that checkpoint to start afresh"
        )
    theirs_job, ours_job = found.fingerprint.get("job", {}), expected["job"]
    fields = sorted(k for k in ours_job if theirs_job.get(k) != ours_job[k])
    if fields:
        detail = "; ".join(f"{k}: checkpoint {theirs_job.get(k)!r}, job {ours_job[k]!r}" for k in fields)
        raise CheckpointMismatchError(
            f"checkpoint {where} belongs to another job ({detail}); resuming would not give the same "
            "model. Point `checkpoint` at another folder, or remove that checkpoint to start afresh"
        )


class CheckpointStore:
    """The checkpoints of one job in one folder (any fsspec URL; `storage_options` are the keyword
    arguments its filesystem needs, such as an S3 endpoint: `ElasticJob.storage_for` gives them).

    One writer per folder: the job's controller (a second controller of the same job is refused by the
    coordinator's registry). Readers may be anywhere, at any time.
    """

    def __init__(self, url: str, keep: int = 3, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.keep = keep
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        # s3fs's makedirs creates a missing *bucket*: a typo in the URL would make a bucket instead of
        # failing. An object store needs no folders anyway (a key prefix is one), so none is made there.
        self._make_folders = not is_object_store(self.fs)

    def check_writable(self) -> None:
        """Fails before training starts if the folder cannot be written."""
        probe = f"{self.root}/.prefect-elastic-probe-{uuid.uuid4().hex}"
        try:
            if self._make_folders:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except FileNotFoundError as exc:
            if not self._make_folders:
                bucket = self.root.split("/", 1)[0]
                raise JobConfigError(
                    "checkpoint",
                    self.url,
                    f"cannot write there: its bucket {bucket!r} does not exist ({exc}); fix the URL, or "
                    "create the bucket (prefect-elastic never creates buckets)",
                ) from exc
            raise self._unwritable(exc) from exc
        except Exception as exc:
            raise self._unwritable(exc) from exc

    def _unwritable(self, exc: Exception) -> JobConfigError:
        return JobConfigError(
            "checkpoint",
            self.url,
            f"cannot write there: {explain_storage_error(exc, self.storage_options)}; give a folder URL "
            "this process and the flow can write",
        )

    def _entries(self) -> list[str]:
        """The names in the folder as the store has them now (not as this process listed them before)."""
        # s3fs and others cache listings per process; a checkpoint another process wrote would be missed.
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]

    def names(self) -> list[str]:
        """The checkpoints in the folder, oldest first (temporaries and other files are not checkpoints)."""
        return sorted(n for n in self._entries() if _NAME.match(n))

    def write(self, checkpoint: Checkpoint) -> str:
        """Write `checkpoint` and return its URL; raises what the storage raised when it cannot, after
        removing its temporary (on a full disk, half a checkpoint would hold the room the next try needs)."""
        data = checkpoint.to_bytes()
        final = f"{self.root}/ckpt-{checkpoint.committed_steps:09d}.pt"
        temporary = f"{self.root}/.tmp-{uuid.uuid4().hex}.pt"
        try:
            if self._make_folders:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(temporary, data)
            self.fs.mv(temporary, final)
        except BaseException:
            try:
                self.fs.rm_file(temporary)
            except Exception as exc:  # (never made, or the folder refuses removals too: the next prune)
                log.debug("removing the temporary %s: %s", temporary, exc)
            raise
        try:
            self.prune()
        except Exception as exc:
            # The checkpoint is whole under its final name; older ones stay until a prune succeeds.
            log.warning("checkpoint %s written, but pruning %s failed: %s", final, self.url, exc)
        log.info("checkpoint written: %s (step %d, %d bytes)", final, checkpoint.committed_steps, len(data))
        return self._url_of(final)

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints; remove older ones and temporaries that a writer which died
        before its move left behind (the one writer of this folder is past its own move by now)."""
        entries = self._entries()
        checkpoints = sorted(n for n in entries if _NAME.match(n))
        stale = [n for n in entries if _TEMPORARY.match(n)]
        for name in [*checkpoints[: -self.keep], *stale]:
            self.fs.rm_file(f"{self.root}/{name}")

    def latest(self) -> tuple[Checkpoint, str] | None:
        """The newest checkpoint and its URL; None when the folder holds none."""
        names = self.names()
        if not names:
            return None
        path = f"{self.root}/{names[-1]}"
        return Checkpoint.from_bytes(self.fs.cat_file(path), self._url_of(path)), self._url_of(path)

    def _url_of(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if protocol == "file" else f"{protocol}://{path}"


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

    def __init__(self, job: ElasticJob, layout: StateLayout, initial: dict[str, torch.Tensor]) -> None:
        self.job = job
        self.layout = layout
        self.initial = initial
        self.expected = fingerprint(job, layout, initial)
        self.store = (
            CheckpointStore(job.checkpoint, job.checkpoint_keep, job.storage_for(job.checkpoint))
            if job.checkpoint
            else None
        )
        self.resumed: Checkpoint | None = None
        self.resumed_from: str | None = None
        self.last_written: str | None = None
        self.written_step = -1
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
                if job.mode == "sync" and any(v != checkpoint.committed_steps for v in checkpoint.versions):
                    raise CheckpointMismatchError(
                        f"checkpoint {where} was written mid-run by an async run (its shards stand at "
                        f"versions {list(checkpoint.versions)}, which a sync run cannot go on from); resume "
                        "it with mode='async', or point `checkpoint` at another folder"
                    )
                self.resumed, self.resumed_from = checkpoint, where
                log.info("job %s resumes from %s at step %d", job.job_id, where, checkpoint.committed_steps)

    def shard_start(self, index: int, names: list[str], checkpoint: Checkpoint | None = None) -> ShardStart:
        """What data server `index` (holding `names`) starts from: `checkpoint`, else the checkpoint this
        run resumed from, else the job's initial values."""
        checkpoint = checkpoint or self.resumed
        source = checkpoint.tensors if checkpoint else self.initial
        params = {n: source[n] for n in names if n in self.layout.params}
        buffers = {n: source[n] for n in names if n not in self.layout.params}
        if checkpoint is None:
            return ShardStart(params, buffers, None, 0)
        if checkpoint.versions:
            return ShardStart(
                params, buffers, checkpoint.optimizers[index], checkpoint.versions[index],
                checkpoint.applied[index],
            )  # fmt: skip
        return ShardStart(params, buffers, checkpoint.optimizers[index], checkpoint.committed_steps)

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
        # (In async mode the coordinator snapshots only every `checkpoint_every` checks: each is written.)
        every = 1 if self.job.mode == "async" else self.job.checkpoint_every
        if self.store is None or self._snapshots % every:
            return None
        failed = len(self.events)
        written = self.write(coordinator, shards, timeout)
        if on_event is not None:
            for event in self.events[failed:]:
                on_event(event)
        if self.failures.ends_job(self.job.checkpoint_failures_allowed):
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
        tensors: dict[str, torch.Tensor] = {}
        for p in parts:
            tensors.update(p["tensors"])
        return Checkpoint(
            job_id=self.job.job_id,
            fingerprint=self.expected,
            generation=record.generation,
            committed_steps=record.committed_steps,
            ledger=record.ledger,
            history=record.history,
            tensors=tensors,
            optimizers=[p["optimizer"] for p in parts],
            versions=tuple(record.versions),
            applied=tuple(tuple(p["applied"]) for p in parts) if record.versions else (),
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
        allowed = self.job.checkpoint_failures_allowed
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
        log.warning("job %s: %s", self.job.job_id, reason)
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
        failures, allowed, url = self.failures, self.job.checkpoint_failures_allowed, self.store.url
        coordinator.stop(f"{failures.in_a_row} checkpoint writes in a row failed").result(timeout=3 * timeout)
        final = self._gather(coordinator.snapshot_record().result(timeout=timeout), shards, timeout)
        step, last = final.committed_steps, self._last_good()
        written = f"the last checkpoint written is {last}" if last else f"{url} holds none of this job"
        return CheckpointWriteError(
            f"job {self.job.job_id}: {failures.in_a_row} checkpoint writes in a row to {url} failed (more "
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
