"""The controller of a job: `train(job, address=... | cluster=...)`.

It owns the job's lifecycle on a Dask cluster: it checks the job before touching the cluster (`prepare`),
registers the job id, starts the data servers and the coordinator on static workers (`actors`), runs a
compute loop on every elastic worker (`loops`), drives survival detection from the scheduler's view of the
workers (`workers`, every `liveness_interval` and at once on a worker event), keeps the static roles
(`roles`, `promotion`), and at the end collects the parameters, the ledger and the events into a
`TrainResult` (`result`). It decides when a membership change is checked (held for a starting worker, for
the rest of a group of joins or losses) and what a lost role becomes (a standby promoted, the coordinator
rebuilt, a retiring worker's roles handed over): `membership`, pure; what the change does to training
(a snapshot, a rollback, the step reassigned) the coordinator decides (`survival.survival_check`).

The Prefect flow calls it by phases (`TrainingRun`); users may call `train` directly.
"""

from .api import connect_client, train
from .prepare import Prepared, prepare
from .result import FaultInjector, TrainResult
from .run import TrainingRun

# (The controller's parts that tests drive, its signals, calls, workers' view and pacing, are imported
# from their modules: this package exports what a user or the flow calls.)
__all__ = ["FaultInjector", "Prepared", "TrainResult", "TrainingRun", "connect_client", "prepare", "train"]
