"""The error tree is the contract: what `train()` and the flow raise is one of `prefect_elastic.errors`'
public errors; the engine's own signals are a family apart, each turned into the public error it means
when nothing inside the engine answered it. Without a cluster: the decision alone."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import prefect_elastic
from prefect_elastic import errors
from prefect_elastic.errors import DataServerLostError, ElasticError, FatalError, SchedulerLostError
from prefect_elastic.training import TrainingRun
from prefect_elastic.training.ending import Ending
from prefect_elastic.training.scheduler import SchedulerWatch
from prefect_elastic.training.signals import (
    CoordinatorLost,
    EngineSignal,
    SchedulerGone,
    StartCancelled,
    StaticWorkerLeft,
)
from prefect_elastic.wire import signals as step_signals
from prefect_elastic.wire.signals import StepSignal

from ..conftest import make_job

SIGNALS = [CoordinatorLost("its static worker left"), StaticWorkerLeft("tcp://w:1"), StartCancelled("k"),
           SchedulerGone(3.0)]  # fmt: skip


def test_the_engines_signals_are_no_public_error() -> None:
    for signal in SIGNALS:
        assert isinstance(signal, EngineSignal) and not isinstance(signal, ElasticError), type(signal)
    public = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert not [e for e in public if issubclass(e, EngineSignal)]


DOCS = Path(__file__).resolve().parents[2] / "docs"


def public_errors() -> dict[str, type[Exception]]:
    """The public errors: every exception class that `prefect_elastic.errors` defines."""
    return {
        name: value
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__
    }


def tree_in(page: str, section: str) -> list[tuple[str, str | None]]:
    """The error tree in `page`'s `section` (its first fenced block): each class with its parent there, read
    from the indent of its `+--`."""
    text = (DOCS / page).read_text()
    block = text[text.index("```", text.index(f"\n## {section}")) :].split("```")[1]
    tree: list[tuple[str, str | None]] = []
    path: list[str] = []
    for line in block.strip("\n").splitlines():
        if branch := re.match(r"^((?:\|   |    )*)\+-- ([A-Za-z]+)", line):
            depth, name = len(branch[1]) // 4 + 1, branch[2]
        elif root := re.match(r"^([A-Za-z]+)", line):
            depth, name = 0, root[1]
        else:
            continue  # (a description's second line)
        del path[depth:]
        tree.append((name, path[-1] if path else None))
        path.append(name)
    return tree


@pytest.mark.parametrize(
    ("page", "section"), [("guide.md", "Errors"), ("architecture.md", "Errors: the contract")]
)
def test_the_docs_error_tree_is_the_codes(page: str, section: str) -> None:
    """Every public error appears once, under its real parent, and nothing else does."""
    tree = tree_in(page, section)
    assert len(tree) == len({name for name, _ in tree}), "a class listed twice"
    real = {
        name: next((b.__name__ for b in cls.__bases__ if issubclass(b, errors.ElasticError)), None)
        for name, cls in public_errors().items()
    }
    assert dict(tree) == real


def test_the_step_paths_signals_are_no_public_error() -> None:
    family = [v for v in vars(step_signals).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert {c.__name__ for c in family} >= {"StepSignal", "RecoverableError", "StaleGenerationError",
                                            "StepPassed", "BackupWanted", "ModelFailure"}  # fmt: skip
    for signal in family:
        assert issubclass(signal, StepSignal) and not issubclass(signal, errors.ElasticError), signal
    assert not [e for e in public_errors().values() if issubclass(e, (StepSignal, EngineSignal))]
    assert not set(public_errors()) & {c.__name__ for c in family}


def a_run(status: str = "running") -> TrainingRun:
    run = object.__new__(TrainingRun)
    run.client = SimpleNamespace(status=status, scheduler=None)  # type: ignore[assignment]
    run.job = make_job("file:///nowhere", job_id="errors")
    run.committed_seen = 3
    run.schedule = SimpleNamespace(total_steps=10)  # type: ignore[assignment]
    run.persistence = SimpleNamespace(last_written="/ckpt/step-2")  # type: ignore[assignment]
    run.scheduler = SchedulerWatch(run.client, run.job)
    # (How the run ends reads the job, its schedule and the checkpoint store here; no call is made.)
    unused = SimpleNamespace()
    run.ending = Ending(run.job, run.schedule, unused, unused, run.persistence, unused)  # type: ignore[arg-type]
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


@pytest.mark.parametrize("name", sorted(errors.MOVED_TO_THE_STEP_PATH))
def test_a_step_signal_named_where_it_was_public_is_found_with_a_warning(name: str) -> None:
    """Code written when the step path's signals were public errors still imports them, and is told that
    they are internal now (nothing a user catches)."""
    with pytest.warns(DeprecationWarning, match="no longer a public error"):
        found = getattr(errors, name)
    assert found is getattr(step_signals, name) and not issubclass(found, errors.ElasticError)
    if name in ("RecoverableError", "StaleGenerationError"):
        with pytest.warns(DeprecationWarning):
            assert getattr(prefect_elastic, name) is found
        assert name not in prefect_elastic.__all__
    with pytest.raises(AttributeError):
        errors.NoSuchError  # noqa: B018
