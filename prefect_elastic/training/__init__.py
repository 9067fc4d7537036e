"""The controller of a job: `train(job, address=... | cluster=...)`.

It owns the job's lifecycle on a Dask cluster: it checks the job before touching the cluster (`prepare`),
registers the job id, starts the data servers and the coordinator on static workers (`actors`), runs a
compute loop on every elastic worker (`loops`), drives survival detection from the scheduler's view of the
workers (`workers`, every `liveness_interval` and at once on a worker event), keeps the static roles
(`roles`, `promotion`), and at the end collects the parameters, the ledger and the events into a
`TrainResult` (`result`). It decides nothing about membership itself: the coordinator does.

The Prefect flow calls it by phases (`TrainingRun`); users may call `train` directly.
"""

from .api import connect_client, train
from .calls import controller_handle, settled_result
from .pacing import PROGRESS_POLL_IDLE_SECONDS, PROGRESS_POLL_SECONDS
from .prepare import Prepared, build_schedule, prepare
from .result import FaultInjector, TrainResult
from .run import TrainingRun
from .signals import CoordinatorLost, SchedulerGone, StartCancelled, StaticWorkerLeft
from .workers import WorkersView, standbys

__all__ = [
    "PROGRESS_POLL_IDLE_SECONDS",
    "PROGRESS_POLL_SECONDS",
    "CoordinatorLost",
    "FaultInjector",
    "Prepared",
    "SchedulerGone",
    "StartCancelled",
    "StaticWorkerLeft",
    "TrainResult",
    "TrainingRun",
    "WorkersView",
    "build_schedule",
    "connect_client",
    "controller_handle",
    "prepare",
    "settled_result",
    "standbys",
    "train",
]
