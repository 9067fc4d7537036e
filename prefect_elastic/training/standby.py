"""Which standby a lost data server's role goes to, and when one being started on is given up."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from ..errors import DataServerLostError
from .pacing import MEMBERSHIP_POLL_SECONDS
from .workers import pass_over_standby, readiest_first

if TYPE_CHECKING:
    from ..job import ElasticJob
    from .role_table import RoleTable
    from .workers import Workers

log = logging.getLogger(__name__)


class StandbyChoice:
    """The standbys as the role table and the workers' view show them."""

    def __init__(self, job: ElasticJob, roles: RoleTable, workers: Workers) -> None:
        self.job = job
        self.roles = roles
        self.workers = workers

    def wait_for_standby(self, index: int, taken: list[str] | None = None) -> str:
        """A static worker holding no data server of this job (nor one of `taken`); waits up to
        `min_workers_timeout` for one to join, then fails naming the role."""
        deadline = time.monotonic() + self.job.min_workers_timeout
        while True:
            free = self.roles.free(self.workers.view().static, taken)
            if free:
                warm = {w for w, f in self.roles.warmed.items() if f.done()}
                warming = set(self.roles.warmed) - warm
                return readiest_first(free, warm, warming)[0]
            if time.monotonic() >= deadline:
                raise DataServerLostError(
                    f"data server {index} of job {self.job.job_id} was lost with its static worker "
                    f"{self.roles.placement[index]}, and no standby static worker joined within "
                    f"{self.job.min_workers_timeout:g} s (min_workers_timeout): start one with "
                    f"`dask worker <scheduler> --resources {self.job.static_resource}=1`"
                )
            time.sleep(MEMBERSHIP_POLL_SECONDS)

    def standby_gone(self, standby: str) -> bool:
        """Whether to give up the standby a data server is being started on (`pass_over_standby`)."""
        view = self.workers.view()
        others = [w for w in view.static if w != standby]
        return pass_over_standby(
            listed=standby in view.static or standby in view.silent_static,
            silent_for=None if standby in view.static else view.silence.get(standby, math.inf),
            another_free=bool(self.roles.free(others)),
            patience=self.job.call_timeout,
        )
