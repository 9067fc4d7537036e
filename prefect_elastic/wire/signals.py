"""The step path's signals: what a shard tells a compute loop about a step (refused, passed, short of
micro-batches), and what a loop's trainer tells its loop (the model failed). They are a family of their
own, apart from the public errors (`prefect_elastic.errors`), and never derive from `ElasticError`: each
is answered inside the engine (a loop drops the step in flight, trains a backup, or reports the failure to
the coordinator), and `train()` never lets one out (`training/run.py`, `public_errors`).

    StepSignal
    +-- RecoverableError          the step in flight is dropped here; training goes on
    |   +-- StaleGenerationError  a message of an older generation, refused, never applied
    |   +-- StepPassed            a push or pull of a step the shard applied already (a straggler's)
    |   +-- BackupWanted          a step's micro-batches are missing: train them for the silent member
    +-- ModelFailure              inside a compute loop only: becomes a `TrainingFailedError`
        +-- DataFailure           a batch could not be made (its samples, the collate): the same

The first four and `DataFailure` (a data server makes batches too) travel on the step channel as error
headers (`codec.error_header`, `codec.raise_error`),
told apart by the header's `error` kind, not by a class name. Compute loops and the coordinator catch
`RecoverableError`.
"""

from __future__ import annotations

from typing import Any


class StepSignal(Exception):
    """Raised and caught on the step path; never what `train()` or the flow raises."""


class RecoverableError(StepSignal):
    """The step in flight is dropped; training goes on."""


class StaleGenerationError(RecoverableError):
    """A message carried an older generation than the receiver's; it was rejected, never applied."""

    def __init__(self, got: int, current: int, what: str = "message") -> None:
        super().__init__(f"stale {what}: generation {got}, current generation is {current}")
        self.got = got
        self.current = current
        self.what = what

    def __reduce__(self) -> tuple[Any, ...]:
        # Signals cross processes (actor calls); keep the constructor arguments, not just the message.
        return (type(self), (self.got, self.current, self.what))


class StepPassed(RecoverableError):
    """A shard refused a push or a pull of `step`: it stands at `version`, past it (the step was applied
    without this worker, from another member's backup of its share: `stragglers.py`)."""

    def __init__(self, step: int, version: int, index: int = -1) -> None:
        super().__init__(f"step {step}, but shard {index} is at step {version}")
        self.step = step
        self.version = version
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.step, self.version, self.index))


class BackupWanted(RecoverableError):
    """A shard's answer to a pull that waited for `step` to be applied: the step stood open too long, and
    `batch_ids` of it are missing. The loop trains its part of them (`stragglers.backup_share`) and pulls
    again."""

    def __init__(self, step: int, batch_ids: tuple[int, ...]) -> None:
        super().__init__(f"step {step} lacks batch ids {list(batch_ids)}: train them as a backup")
        self.step = step
        self.batch_ids = batch_ids

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.step, self.batch_ids))


class ModelFailure(StepSignal):
    """Raised inside a compute loop when the model raised or its loss was not finite; the loop reports it
    to the coordinator, which ends the job with a `TrainingFailedError`."""

    # What the loop reports (`Coordinator.report_failure`): a model's failure excludes the worker and trains
    # the batch again elsewhere (a bad node); a data failure ends the job at once.
    kind = "model"

    def __init__(self, step: int, batch_id: int, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.batch_id = batch_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.step, self.batch_id, str(self)))


class DataFailure(ModelFailure):
    """A batch could not be made: a sample did not read, or the collate could not batch the samples. It
    names the batch id and the index of the sample, and ends the job with a `TrainingFailedError` at once:
    made again, on any worker, the batch would fail again, so no worker is excluded for it."""

    kind = "data"
