"""The error tree is the contract: what `train()` and the flow raise is one of `prefect_elastic.errors`'
public errors; the engine's own signals are a family apart, each turned into the public error it means
when nothing inside the engine answered it. Without a cluster: the decision alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prefect_elastic import errors
from prefect_elastic.errors import DataServerLostError, ElasticError, FatalError, SchedulerLostError
from prefect_elastic.training import TrainingRun
from prefect_elastic.training.scheduler import SchedulerWatch
from prefect_elastic.training.signals import (
    CoordinatorLost,
    EngineSignal,
    SchedulerGone,
    StartCancelled,
    StaticWorkerLeft,
)

from ..conftest import make_job

SIGNALS = [CoordinatorLost("its static worker left"), StaticWorkerLeft("tcp://w:1"), StartCancelled("k"),
           SchedulerGone(3.0)]  # fmt: skip


def test_the_engines_signals_are_no_public_error() -> None:
    for signal in SIGNALS:
        assert isinstance(signal, EngineSignal) and not isinstance(signal, ElasticError), type(signal)
    public = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert not [e for e in public if issubclass(e, EngineSignal)]


def a_run(status: str = "running") -> TrainingRun:
    run = object.__new__(TrainingRun)
    run.client = SimpleNamespace(status=status, scheduler=None)  # type: ignore[assignment]
    run.job = make_job("file:///nowhere", job_id="errors")
    run.committed_seen = 3
    run.schedule = SimpleNamespace(total_steps=10)  # type: ignore[assignment]
    run.persistence = SimpleNamespace(last_written="/ckpt/step-2")  # type: ignore[assignment]
    run._scheduler_gone_since = None
    run.scheduler = SchedulerWatch(run)
    return run


@pytest.mark.parametrize("signal", SIGNALS, ids=lambda s: type(s).__name__)
def test_a_signal_nothing_answered_becomes_the_public_error_it_means(signal: EngineSignal) -> None:
    error = a_run().public_error(signal)
    assert isinstance(error, FatalError) and "errors" in str(error), error
    if isinstance(signal, (CoordinatorLost, StaticWorkerLeft, StartCancelled)):
        assert isinstance(error, DataServerLostError)
    if isinstance(signal, SchedulerGone):
        assert isinstance(error, SchedulerLostError)


def test_anything_else_is_unexpected_and_says_where_the_job_resumes() -> None:
    error = a_run().public_error(RuntimeError("a bug"))
    assert type(error) is FatalError
    assert "stopped at step 3 of 10 on an unexpected RuntimeError: a bug" in str(error)
    assert "/ckpt/step-2" in str(error)
    kept = DataServerLostError("as it was")
    assert a_run().public_error(kept) is kept, "a public error passes unchanged"


def test_with_the_scheduler_gone_whatever_failed_is_its_loss() -> None:
    error = a_run(status="connecting").public_error(RuntimeError("a cancelled future"))
    assert isinstance(error, SchedulerLostError) and "lost the Dask scheduler" in str(error)


def test_every_phase_raises_public_errors_only() -> None:
    run = a_run()

    def broken() -> None:
        raise StaticWorkerLeft("tcp://w:1")

    run._supervise = broken  # type: ignore[method-assign]
    run.roles = SimpleNamespace()  # type: ignore[assignment]
    with pytest.raises(DataServerLostError, match="static worker tcp://w:1 left"):
        run.supervise()


def test_dasks_failures_are_told_apart_by_dask_failures_alone() -> None:
    from prefect_elastic.dask_failures import actor_lost, actor_unreachable

    assert actor_lost(RuntimeError("Worker holding Actor was lost.  Status: error"))
    assert not actor_lost(RuntimeError("the model raised")) and not actor_lost(OSError("Actor was lost"))
    assert actor_unreachable(OSError("Unable to contact Actor's worker tcp://w:1"))
    assert not actor_unreachable(ConnectionResetError("Unable to contact Actor's worker")), (
        "a subclass is a call's"
    )
