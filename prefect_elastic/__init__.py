"""prefect-elastic: elastic PyTorch training on Dask clusters whose workers come and go."""

from .coordinator import MembershipEvent, Progress
from .errors import (
    DataServerLostError,
    ElasticError,
    FatalError,
    JobConfigError,
    NotEnoughWorkersError,
    RecoverableError,
    StaleGenerationError,
    TrainingFailedError,
)
from .job import ElasticJob
from .ledger import LedgerEntry
from .training import TrainResult, train

__all__ = [
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
    "StaleGenerationError",
    "TrainResult",
    "TrainingFailedError",
    "train",
]
