"""The local harness without a Dask cluster: process groups (`local.processes`) and the decisions of
`FaultSchedule`, run against a stand-in for `LocalElasticCluster` that records the signals it is asked for."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.local.processes import log_tail, signal_group, start_group, stop_groups
from prefect_elastic.messages import Progress


def _ended(pid: int) -> bool:
    """Gone, or a zombie that nobody has reaped yet (it holds no resources and runs no code)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait(what: str, probe: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_stop_groups_ends_a_stopped_group_that_ignores_sigterm_and_its_children(tmp_path: Path) -> None:
    script = "trap '' TERM; sleep 300 & echo $! > child.pid; wait"
    proc = start_group(["sh", "-c", script], log=tmp_path / "group.log", env=os.environ, cwd=tmp_path)
    assert os.getpgid(proc.pid) == proc.pid, "the leader of a process group of its own"
    _wait("the child to start", (tmp_path / "child.pid").exists)
    _wait("the pid to be written", lambda: (tmp_path / "child.pid").read_text().strip())
    child = int((tmp_path / "child.pid").read_text())
    signal_group(proc, signal.SIGSTOP)

    started = time.monotonic()
    stop_groups([proc], grace=0.5)

    assert proc.returncode == -signal.SIGKILL, "SIGTERM was ignored, so the SIGKILL after the grace ended it"
    assert time.monotonic() - started < 5
    _wait("the child to end", lambda: _ended(child))
    signal_group(proc, signal.SIGKILL)  # a group that is gone is no error


def test_start_group_appends_output_to_its_log_and_log_tail_reads_it(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    log.write_text("from before\n")
    proc = start_group(["sh", "-c", "echo one; echo two >&2"], log=log, env=os.environ, cwd=tmp_path)
    assert proc.wait(30) == 0
    assert log.read_text() == "from before\none\ntwo\n"
    assert log_tail(log, lines=2) == f"--- last 2 lines of {log} ---\none\ntwo"
    assert "unreadable" in log_tail(tmp_path / "absent.log")


# -- FaultSchedule ------------------------------------------------------------------------------------------


class StandIn:
    """What FaultSchedule uses of a LocalElasticCluster, recording the signals instead of sending them."""

    def __init__(self, *elastic: str) -> None:
        self.elastic = list(elastic)
        self.signals: list[tuple[str, int]] = []

    def elastic_addresses(self) -> list[str]:
        return sorted(self.elastic)

    def kill_worker(self, name_or_address: str, sig: int = signal.SIGKILL, restart: bool = False) -> None:
        self.signals.append((name_or_address, sig))


def progress(step: int, members: tuple[str, ...], holding: dict[str, int]) -> Progress:
    return Progress(
        generation=1,
        committed_steps=step,
        total_steps=100,
        workers=members,
        state="running",
        loss=1.0,
        holding=tuple(sorted(holding.items())),
    )


def test_freeze_is_recorded_for_a_member_holding_micro_batches_whatever_it_holds_after() -> None:
    cluster = StandIn("a", "b")
    faults = FaultSchedule(seed=0).freeze_worker(at_step=3).bind(cluster)  # type: ignore[arg-type]
    # Each member holds its share of the open step; the share does not change once its holder froze.
    shares = {"a": 0, "b": 2}  # "a" has none of this step: only "b" can be frozen holding micro-batches
    faults.apply(progress(2, ("a", "b"), shares))
    assert cluster.signals == [], "not due yet"

    faults.apply(progress(3, ("a", "b"), shares))
    assert cluster.signals == [("b", signal.SIGSTOP)]
    assert faults.log == [], "recorded once a progress after the stop shows it"

    faults.apply(progress(3, ("a", "b"), shares))
    assert [(r.kind, r.target, r.step) for r in faults.log] == [("freeze", "b", 3)]
    assert cluster.signals == [("b", signal.SIGSTOP)]
    assert not faults.faults


def test_freeze_of_a_worker_that_left_the_membership_is_undone_and_tried_again() -> None:
    cluster = StandIn("a", "b")
    faults = FaultSchedule(seed=0).freeze_worker(at_step=1).bind(cluster)  # type: ignore[arg-type]
    faults.apply(progress(1, ("a",), {"a": 4}))
    assert cluster.signals == [("a", signal.SIGSTOP)], "b is no member, so it holds nothing"

    # The next progress comes from a new generation without "a": it left before the stop took effect.
    faults.apply(progress(1, ("b",), {"b": 4}))
    assert cluster.signals == [("a", signal.SIGSTOP), ("a", signal.SIGCONT), ("b", signal.SIGSTOP)]
    faults.apply(progress(2, ("b",), {"b": 4}))
    assert [(r.kind, r.target) for r in faults.log] == [("freeze", "b")]


def test_freeze_waits_while_no_member_holds_micro_batches() -> None:
    cluster = StandIn("a")
    faults = FaultSchedule(seed=0).freeze_worker(at_step=0).bind(cluster)  # type: ignore[arg-type]
    faults.apply(progress(0, ("a",), {}))
    faults.apply(progress(1, (), {"a": 4}))  # holding, but no member (waiting for workers)
    assert cluster.signals == [] and len(faults.faults) == 1
    faults.apply(progress(2, ("a",), {"a": 4}))
    assert cluster.signals == [("a", signal.SIGSTOP)]
