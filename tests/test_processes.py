"""The harness's process groups (`local/processes.py`), on real processes without a cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from prefect_elastic.local.processes import signal_group, start_group

from .conftest import wait_for

# A leader that starts a long-lived child and exits at once: the child keeps the group going.
LEADER_THAT_LEAVES_A_CHILD = (
    "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
)


def members(pgid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def test_a_group_whose_leader_exited_is_still_signalled(tmp_path: Path) -> None:
    leader = start_group(
        [sys.executable, "-c", LEADER_THAT_LEAVES_A_CHILD], log=tmp_path / "log", env=os.environ, cwd=tmp_path
    )
    leader.wait(timeout=30)
    wait_for("the child to run in the group", lambda: members(leader.pid), timeout=30, poll=0.05)
    signal_group(leader, signal.SIGKILL)
    wait_for("the child to be gone", lambda: not members(leader.pid), timeout=10, poll=0.05)


def test_a_group_id_the_kernel_gave_to_another_group_is_not_signalled(tmp_path: Path) -> None:
    """Once every process of a group is gone, the kernel may give its number to a new process that leads
    a group of its own (another cluster's worker): signalling the old group must not reach it. (Seen in
    the chaos soak: a test's cluster, closing, stopped another test's coordinator; pid_max is 32768 here.)"""
    leader = start_group([sys.executable, "-c", "pass"], log=tmp_path / "log", env=os.environ, cwd=tmp_path)
    leader.wait(timeout=30)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        leader.pid = stranger.pid  # what a reused number looks like from here
        signal_group(leader, signal.SIGTERM)
        time.sleep(0.3)
        assert stranger.poll() is None, "a group that is not ours was signalled"
    finally:
        stranger.kill()
        stranger.wait()
