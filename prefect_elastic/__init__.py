"""prefect-elastic: elastic PyTorch training on Dask clusters whose workers come and go.

The names below are imported on first use (PEP 562), not with the package: the scheduler and every nanny
unpickle this package's plugins and scheduler-side functions (`cluster/`, `registry.py`), and importing
torch there for nothing cost each process 2 s of CPU and about 300 MB."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .errors import (
        CheckpointMismatchError,
        DataServerLostError,
        ElasticError,
        FatalError,
        JobConfigError,
        NotEnoughWorkersError,
        SchedulerLostError,
        TrainingFailedError,
        TrainingStopped,
    )
    from .job import ElasticJob
    from .ledger import LedgerEntry
    from .messages import MembershipEvent, Progress
    from .training import TrainResult, train

_WHERE = {
    "CheckpointMismatchError": "errors",
    "DataServerLostError": "errors",
    "ElasticError": "errors",
    "FatalError": "errors",
    "JobConfigError": "errors",
    "NotEnoughWorkersError": "errors",
    "SchedulerLostError": "errors",
    "TrainingFailedError": "errors",
    "TrainingStopped": "errors",
    "ElasticJob": "job",
    "LedgerEntry": "ledger",
    "MembershipEvent": "messages",
    "Progress": "messages",
    "TrainResult": "training",
    "train": "training",
}

__all__ = [
    "CheckpointMismatchError",
    "DataServerLostError",
    "ElasticError",
    "ElasticJob",
    "FatalError",
    "JobConfigError",
    "LedgerEntry",
    "MembershipEvent",
    "NotEnoughWorkersError",
    "Progress",
    "SchedulerLostError",
    "TrainResult",
    "TrainingFailedError",
    "TrainingStopped",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in (
        "RecoverableError",
        "StaleGenerationError",
    ):  # (once public: `errors.py` says where they went)
        return getattr(importlib.import_module(".errors", __name__), name)
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # (looked up once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
