"""The controller's copy of the coordinator's record (ledger, history, events), brought up to date after
every survival check: a coordinator whose worker dies is rebuilt from it and from the shards."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..messages import Journal

if TYPE_CHECKING:
    from .calls import Calls
    from .role_table import RoleTable


class RecordCopy:
    """The copy, and the calls that bring it up to date."""

    def __init__(self, calls: Calls, roles: RoleTable) -> None:
        self.calls = calls
        self.roles = roles
        self.journal = Journal()

    def update(self) -> None:
        """Bring the copy up to date with the coordinator's record (`Journal`)."""
        part: Journal = self.calls.call(
            self.roles.coordinator.journal(self.journal.committed_steps, len(self.journal.events))
        )
        self.journal.extend(part)

    def restart(self) -> None:
        """The coordinator's record started afresh (every shard back to a checkpoint): so does the copy."""
        self.journal = Journal()
        self.update()

    def behind(self, events: int) -> bool:
        """Whether the coordinator recorded more than `events` events, more than the copy holds."""
        return events > len(self.journal.events)
