"""Every shard back to the checkpoint, in the same run: what the controller does when a shard's last copy is
lost (its data server died with the peer that held its replica, or with the coordinator)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from distributed import Client

from ..errors import DataServerLostError
from ..messages import EventKind, MembershipEvent
from .calls import settled_result

if TYPE_CHECKING:
    from .actors import Actors
    from .calls import Calls
    from .prepare import Prepared
    from .record_copy import RecordCopy
    from .role_table import RoleTable
    from .standby import StandbyChoice

log = logging.getLogger(__name__)


class CheckpointFallback:
    """Every shard started afresh from the newest checkpoint; the coordinator rebuilt to that step."""

    def __init__(
        self,
        client: Client,
        prepared: Prepared,
        roles: RoleTable,
        calls: Calls,
        actors: Actors,
        standbys: StandbyChoice,
        record: RecordCopy,
        check_soon: Callable[[], None],
    ) -> None:
        self.client = client
        self.prepared = prepared
        self.job = prepared.job
        self.roles = roles
        self.calls = calls
        self.actors = actors
        self.standbys = standbys
        self.record = record
        self.check_soon = check_soon  # a survival check hands the roles out again at once

    def restore(self, lost: list[int], why: str) -> None:
        """Data servers lost with the replicas of their shards: every shard goes back to the newest
        persistent checkpoint in the same run (the lost ones on standbys, the others on their workers, all
        started afresh from it), and the coordinator to the record of that step (`Coordinator.rebuild`
        from the controller's copy). Without `checkpoint` on the job, fails naming the lost data servers."""
        job = self.job
        if self.prepared.mode.shards_apart:
            # (The coordinator's loss too, with data server 0 and no replica of its shard: the shards stand
            # at different versions, which the rebuild from a checkpoint does not handle yet.)
            raise DataServerLostError(
                f"{why}; async mode cannot go back to a checkpoint in the same run yet "
                "(docs/design/async.md): run the job again (it resumes from its checkpoint), or use "
                "mode='sync'"
            )
        found = self.prepared.persistence.fallback()
        if found is None:
            raise DataServerLostError(
                f"{why}. Job {job.job_id} has no `checkpoint` to go back to in the same run: set one, or "
                "run the job again (with `checkpoint` set it resumes from the last checkpoint)"
            )
        checkpoint, source = found
        began, clock = time.time(), time.monotonic()
        log.warning("job %s: %s; every shard goes back to %s", job.job_id, why, source)
        roles = self.roles
        holders = list(roles.placement)
        for i in lost:
            holders[i] = self.standbys.wait_for_standby(i, taken=holders)
        futures = [
            self.actors.submit_data_server(
                i, holders[i], self.prepared.persistence.shard_start(i, names, checkpoint)
            )
            for i, names in enumerate(roles.plan)
        ]
        shards = [settled_result(f, self.actors.startup_timeout()) for f in futures]
        channels = [s.open_channel().result(timeout=job.call_timeout) for s in shards]
        for i, shard in enumerate(roles.shards):
            if i not in lost:
                with contextlib.suppress(Exception):
                    shard.close_channel().result(timeout=job.call_timeout)
        old = [roles.move(i, holders[i], futures[i], shards[i], channels[i])[0] for i in range(len(futures))]
        with contextlib.suppress(Exception):
            self.client.cancel([f for f in old if f is not None])
        version = checkpoint.committed_steps if checkpoint is not None else 0
        event: MembershipEvent = self.calls.call(
            roles.coordinator.rebuild(
                self.record.journal, roles.shards, roles.channels, [], roles.coordinator_at,
                f"{why}; every shard went back to {source} (step {version})", began, EventKind.RESTORED,
            ),
            timeout=3 * job.call_timeout,
        )  # fmt: skip
        self.record.restart()
        self.check_soon()
        log.warning(
            "job %s: every shard back to %s at step %d in %.2f s (%d committed steps to train again)",
            job.job_id, source, event.step, time.monotonic() - clock, event.steps_lost,
        )  # fmt: skip
