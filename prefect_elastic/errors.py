"""The errors a user of prefect-elastic catches, as one small tree that says what each means for recovery.

    ElasticError
    +-- FatalError                the job stops; the controller raises it with a message a user can act on
    |   +-- TrainingFailedError   the model raised, or the loss was not finite (names step and batch)
    |   +-- NotEnoughWorkersError fewer than min_workers for longer than min_workers_timeout
    |   +-- DataServerLostError   a static role was lost and nothing can take it over
    |   +-- SchedulerLostError    the Dask scheduler went away; run the job again once one is back
    |   +-- CheckpointMismatchError  the checkpoint belongs to another job or model
    |   +-- CheckpointWriteError  checkpoint writes kept failing; it holds the final parameters
    +-- TrainingStopped           the controller was asked to stop; not a failure
    +-- JobConfigError (also ValueError)  an impossible value, before any cluster work

Only these leave `train()` and the flow. The engine's own signals are families apart that never derive
from `ElasticError`: the step path's (`wire/signals.py`: a step dropped, passed or short of micro-batches,
a model's failure inside a loop) and the controller's (`training/signals.py`). A `FatalError` raised by a
data server ends a compute loop at once (it is never retried).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (types only: checkpoint/ imports this module, and errors cross torch-less processes)
    import torch


class ElasticError(Exception):
    """Base of every error that leaves `train()` and the flow (the engine's own signals never derive
    from it)."""


class FatalError(ElasticError):
    """The job cannot go on; the message says why and what to do."""


class TrainingFailedError(FatalError):
    """A compute worker's step failed in a way that retrying would not fix (the model raised, NaN loss)."""

    def __init__(self, message: str, step: int | None = None, batch_id: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.batch_id = batch_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.step, self.batch_id))


class TrainingStopped(ElasticError):
    """The controller was asked to stop (a cancelled flow run); a final checkpoint was written if the job
    has a checkpoint URL, and a new run of the same job resumes from it."""

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.checkpoint))


class NotEnoughWorkersError(FatalError):
    """Fewer than `min_workers` compute workers were alive for longer than `min_workers_timeout`."""


class DataServerLostError(FatalError):
    """A static role was lost and nothing can take it over: no static worker left or joined within
    `min_workers_timeout` to take it, or a shard died with its copy and the job has no checkpoint."""


class SchedulerLostError(FatalError):
    """The Dask scheduler was lost (it died, or its host did): Dask cancels every future of the job, so the
    controller stops it at once and says where to resume from (`checkpoint`, the last one written); a new
    run of the job resumes there once a scheduler and workers are back."""

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class JobConfigError(ElasticError, ValueError):
    """An impossible value in the job; names the field, the value and what to do."""

    def __init__(self, field: str, value: Any, problem: str) -> None:
        shown = repr(value)
        if len(shown) > 200:
            shown = shown[:197] + "..."
        super().__init__(f"{field}={shown}: {problem}")
        self.field = field
        self.value = value
        self.problem = problem

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.value, self.problem))


class CheckpointMismatchError(FatalError):
    """The checkpoint at the URL belongs to another job or another model."""


class CheckpointWriteError(FatalError):
    """More checkpoint writes failed in a row than `ElasticJob.checkpoint_failures_allowed` (a full disk, a
    folder made read-only, storage that refuses writes): training stopped, and nothing trained is lost.

    `checkpoint`: the last checkpoint written, which loads (None when none was). `final`: the state every
    shard held when training stopped, as a whole checkpoint (`CheckpointStore(url).write(error.final)`
    puts it where a new run of the job resumes from); `state_dict`: its parameters and buffers, as
    `TrainResult.state_dict` would hold them; `step`: the committed steps they hold."""

    def __init__(
        self,
        message: str,
        checkpoint: str | None,
        final: Any,  # a `checkpoint.Checkpoint` (not imported: the checkpoint package imports this module)
        state_dict: dict[str, torch.Tensor],
        step: int,
    ) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.final = final
        self.state_dict = state_dict
        self.step = step

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.checkpoint, self.final, self.state_dict, self.step))


# The step path's signals lived here until they became a family of their own (`wire/signals.py`). Code
# that names them here still finds them, with a warning: `train()` never raises one, so a user's `except`
# of one never runs.
MOVED_TO_THE_STEP_PATH = frozenset(
    {"RecoverableError", "StaleGenerationError", "StepPassed", "BackupWanted", "ModelFailure"}
)


def __getattr__(name: str) -> Any:
    if name not in MOVED_TO_THE_STEP_PATH:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{name} is no longer a public error: it is an internal signal of the step path "
        f"(prefect_elastic.wire.signals.{name}), which train() and the flow never raise; catch ElasticError "
        "or FatalError instead",
        DeprecationWarning,
        stacklevel=2,
    )
    from .wire.signals import BackupWanted, ModelFailure, RecoverableError, StaleGenerationError, StepPassed

    moved = (BackupWanted, ModelFailure, RecoverableError, StaleGenerationError, StepPassed)
    return next(signal for signal in moved if signal.__name__ == name)
