"""The engine's internal signals: what one part of the engine tells another (the coordinator's worker is
gone, the scheduler is gone, a static worker a call depends on left, Dask cancelled a start). They are a
family of their own, apart from the public errors (`prefect_elastic.errors`): each is answered inside the
engine, and one that reaches `train()` unanswered is turned into the public error its `public()` names.
"""

from __future__ import annotations

from ..errors import DataServerLostError, FatalError, SchedulerLostError


class EngineSignal(Exception):
    """Raised and caught inside the engine; never what `train()` or the flow raises."""

    def public(self, job_id: str) -> FatalError:
        """The public error this signal means when nothing inside the engine could answer it."""
        return FatalError(f"job {job_id}: {self}; run the job again, and if it happens again, report it")


class SchedulerGone(EngineSignal):
    """No scheduler connection for `seconds`; the controller stops the job (`SchedulerLostError`)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no scheduler for {seconds:.1f} s")
        self.seconds = seconds

    def public(self, job_id: str) -> FatalError:
        return SchedulerLostError(f"job {job_id} lost the Dask scheduler ({self}); run the job again")


class CoordinatorLost(EngineSignal):
    """The coordinator's static worker left the cluster: the controller rebuilds it on another one."""

    def public(self, job_id: str) -> FatalError:
        return DataServerLostError(
            f"the coordinator of job {job_id} was lost ({self}) where it could not be rebuilt; run the job "
            "again (with `checkpoint` set, it resumes from the last checkpoint)"
        )


class StaticWorkerLeft(EngineSignal):
    """A static worker that a call depends on left the cluster while the call waited."""

    def __init__(self, worker: str) -> None:
        super().__init__(f"static worker {worker} left")
        self.worker = worker

    def public(self, job_id: str) -> FatalError:
        return DataServerLostError(
            f"job {job_id}: {self} where its role could not move; run the job again (with `checkpoint` set, "
            "it resumes from the last checkpoint)"
        )


class StartCancelled(EngineSignal):
    """Dask cancelled the task that starts an actor while the controller waited for it (seen in the chaos
    soak with its worker alive): the start is tried again."""

    def __init__(self, key: str) -> None:
        super().__init__(f"Dask cancelled the start of {key}")
        self.key = key

    def public(self, job_id: str) -> FatalError:
        return DataServerLostError(
            f"job {job_id} could not start its actors: {self}, again and again; check the static workers' "
            "logs, then run the job again"
        )
