"""What a shard's apply is to the rest of the data server (`StepApplies`), whichever mode's it is
(`apply.py`: `SyncApplies` in sync mode, `AsyncApplies` in async mode), and what makes one (`ApplyMode`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..messages import Tensors
from ..schedule import Schedule
from ..wire import Apply, Confirm, Part, Push
from .hooks import ServerHooks
from .optimizer import Gradient
from .state import ShardState


class StepApplies(Protocol):
    """How a shard takes gradients and applies them, and what that means for a fence and its replicas."""

    async def push(self, push: Push, grads: dict[int, Gradient], buffers: dict[int, Tensors]) -> None:
        """The gradients and buffers (by batch id) of the batch ids `push.losses` names, of step `push.step`
        (sync mode); where `push.bucketed`, their gradients came before, in parts (`part`), and this push
        seals them."""

    async def part(self, part: Part, run: torch.Tensor) -> None:
        """One micro-batch's gradient (`run`) of one bucket of the shard's flat parameters (`part.bounds`:
        every bucket's range), sent during backward (sync mode, `overlap_push`); never answered."""

    async def pull(self, generation: int, step: int, wait: float, asker: str | None = None) -> Tensors:
        """The parameters and buffers as of `step`, waiting up to `wait` s for them (sync mode). `asker`:
        the worker that asks, which may be asked instead to train the micro-batches the step before lacks
        (`BackupWanted`); None: never."""

    async def confirm(self, confirm: Confirm) -> None:
        """A member's own copies of `confirm.batch_ids`, held aside where this shard had asked for a
        backup of them, go in: it pushed them to every shard before any applied the step (sync mode)."""

    async def apply_one(self, apply: Apply, grads: Tensors, buffers: Tensors) -> tuple[str, int]:
        """One micro-batch's gradient, applied at once (async mode): the outcome and its staleness."""

    async def current(self, generation: int) -> tuple[int, Tensors]:
        """The version and a copy of the parameters and buffers as they are now (async mode)."""

    async def current_for_answer(self, generation: int) -> tuple[int, Tensors]:
        """`current`, for a frame's answer (no copy where that is safe)."""

    async def advance(self) -> None:
        """Apply what is complete and no hold keeps (after a hold is lifted or raised)."""

    async def step_back(self, version: int) -> int:
        """Back to `version`, the one before this shard's, where that is possible (sync mode, the other
        copy holding it); returns the version, or raises RecoverableError."""

    async def settle(self) -> int:
        """For a fence: the apply under way ends, the gradients held of unapplied steps are dropped;
        returns how many of the open step's there were."""

    def drop_open(self) -> None:
        """A restore: the gradients held of unapplied steps are dropped."""

    def reset(self) -> None:
        """The shard took a whole new state (a promotion): nothing held of the old one counts."""

    @property
    def pending(self) -> int:
        """The micro-batches of the open step whose gradients the shard holds."""

    @property
    def parts_phases(self) -> dict[str, float]:
        """Where gradients come in parts (`bucketed.py`): `parts` taken during the senders' backward,
        `parts_dropped` those a fence or a restore dropped with their open step, `buckets_applied` the
        buckets applied into the other copy before their step's commit (`buckets_undone`: of those, the
        ones dropped with their step), and `apply_buckets` the seconds that took."""

    def applied_from(self, first: int) -> tuple[int, ...] | None:
        """The batch ids applied here from `first` on, for a rebuilt coordinator (None: not kept)."""

    def replicas_kept(self, versions: list[int], keep: int) -> set[int]:
        """Of the copies of the peer's snapshots (by version), the ones to keep."""


class ApplyMode(Protocol):
    """What a mode gives a data server (`Mode.applies`): makes the apply of one shard."""

    def __call__(
        self, state: ShardState, schedule: Schedule, hooks: ServerHooks, max_staleness: int
    ) -> StepApplies: ...
