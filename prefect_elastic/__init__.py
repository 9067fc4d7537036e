"""prefect-elastic: elastic PyTorch training on Dask clusters whose workers come and go."""

from .errors import (
    CheckpointMismatchError,
    DataServerLostError,
    ElasticError,
    FatalError,
    JobConfigError,
    NotEnoughWorkersError,
    RecoverableError,
    SchedulerLostError,
    StaleGenerationError,
    TrainingFailedError,
    TrainingStopped,
)
from .job import ElasticJob
from .ledger import LedgerEntry
from .messages import MembershipEvent, Progress
from .training import TrainResult, train

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
    "RecoverableError",
    "SchedulerLostError",
    "StaleGenerationError",
    "TrainResult",
    "TrainingFailedError",
    "TrainingStopped",
    "train",
]
