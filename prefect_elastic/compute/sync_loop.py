"""The compute loop in sync mode (`SyncLoop`): every member trains its share of every step.

Its share of step `s` is `Schedule.share(s, rank, members)`. On its own connection to every shard it asks
for the next step's batches before a step computes, computes one gradient per micro-batch, and sends
every shard one frame: its slice of the gradients with the losses, tagged (generation, step), and a
request for the next step's parameters (`MicroBatchTrainer.step`). The shard that holds all of a step's
gradients applies the step and answers, so the only wait between two steps is the round trip and the
apply.

A step that stood open too long with another member's micro-batches missing (a paused member, a cut
link) is finished by the members that pushed theirs: the shard answers the pull of the next step with the
batch ids it lacks (`BackupWanted`), each member trains its part of them (`stragglers.backup_share`) and
pushes them as a backup, then goes on. A loop whose push or pull the shards went past (`StepPassed`: it was
the straggler) goes on from where they are (`stragglers.catch_up`).

A stale generation sends the loop back to the coordinator for its new role; another recoverable error
retries the step; a `FatalError` from a shard ends the loop at once; a model that raises or a loss that is
not finite is reported to the coordinator as a failure that ends the job, naming the step and the batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..allocator import freeze_startup_objects
from ..errors import FatalError
from ..messages import Role
from ..stragglers import backup_share, catch_up
from ..wire import ShardLink, unread_answers_dropped
from ..wire.signals import BackupWanted, ModelFailure, RecoverableError, StaleGenerationError, StepPassed
from .frames import Ahead
from .loop import MAX_CONSECUTIVE_CALL_ERRORS, LoopContext, ask_role, reconnect
from .stats import LoopStats
from .trainer import MicroBatchTrainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncLoop:
    """The `Loop` of sync mode."""

    def run(self, context: LoopContext) -> LoopStats:
        address, coordinator, trainer = context.address, context.coordinator, context.trainer
        schedule, stats, timeout, wanted = context.schedule, context.stats, context.timeout, context.wanted
        shards, pushes = context.shards, context.pushes
        spec = trainer.spec
        role: Role | None = None
        known = -1  # the generation whose role the loop has (or had)
        step = 0
        errors = 0
        retries = 0
        ahead: Ahead | None = None
        resume = (-1, 0)  # (generation, step) to go on from if the coordinator gives the same role again
        backup: tuple[int, tuple[int, ...]] | None = None  # (step, batch ids) to train for a silent member
        # (generation, step, share) of this loop's last push of its own share that no shard refused: the
        # ids of it a shard holds aside are this loop's to confirm (`MicroBatchTrainer.confirm`).
        pushed: tuple[int, int, tuple[int, ...]] | None = None
        unreachable: list[float] = []  # when each failed connection to a shard since the last step failed
        while wanted():
            if role is None or step >= schedule.total_steps:
                # No role yet, a new generation, or past the last step: ask (a long poll of the coordinator).
                got, errors = ask_role(coordinator, address, known, stats, spec, errors)
                if got is None:
                    continue
                if got.stop:
                    break
                reconnect(shards, got.channels, timeout)
                if got.generation == resume[0]:
                    # The role this loop had, asked again after a shard did not answer: go on where it was.
                    role, known, step, ahead = got, got.generation, resume[1], None
                else:
                    role, known, step, ahead, retries = got, got.generation, got.start_step, None, 0
                    errors = 0
                resume, backup = (-1, 0), None
                log.debug("compute %s: rank %d of %d from step %d", address, role.rank, role.size, step)
                continue
            # A backup of the step before this one (its answers are this step's), else this step's share.
            at, share = backup or (step, schedule.share(step, role.rank, role.size))
            backup = None
            if not share:
                step += 1  # more members than micro-batches in this step
                continue
            try:
                with unread_answers_dropped(shards):
                    ahead = trainer.step(
                        role, at, share, shards, schedule, stats, ahead, pushes, backup=at != step
                    )
                if at != step:
                    stats.backups += len(share)
                    continue
                stats.trained()
                pushed = (role.generation, step, share)
                freeze_startup_objects()  # (once per process, after its first step: see allocator.py)
                step += 1
                errors = retries = 0
                unreachable.clear()
            except BackupWanted as asked:
                # The step before stands open, a member's micro-batches missing: train this loop's part of
                # them, then this step (whose answers the backup's push asks for). (Asked again, if the ids
                # are still missing, only a wait later.)
                ahead = None
                log.debug("compute %s: back up %s of step %d", address, asked.batch_ids, asked.step)
                if pushed is not None and pushed[:2] == (role.generation, asked.step):
                    confirm(trainer, role, asked, pushed[2], shards)
                if asked.step == step - 1:
                    batches = schedule.step_batches(asked.step)
                    mine = backup_share(asked.batch_ids, batches, role.rank, role.size)
                    backup = (asked.step, mine) if mine else None
            except StepPassed as passed:
                # The shards went past the step this loop pushed or pulled: it was the straggler (the step
                # was applied from the others' backup of its share), or its backup came after the step
                # was applied.
                ahead, pushed = None, None
                log.debug("compute %s: step %d passed: the shards are at %d", address, step, passed.version)
                step = catch_up(step, passed.version, schedule.total_steps)
            except ModelFailure as failure:
                coordinator.report_failure(
                    role.generation, address, failure.step, failure.batch_id, failure.kind, str(failure)
                ).result(timeout=timeout)
                role, ahead = None, None  # the job ends, or (an old generation's failure) the loop goes on
            except StaleGenerationError as exc:
                stats.stale += 1
                log.debug("compute %s: step %d of an old generation: %s", address, step, exc)
                role, ahead = None, None
            except RecoverableError as exc:
                # The step before was not applied within the pull's wait (a straggler, or a member that froze
                # and is about to be removed): try this step again. A loop that keeps failing asks for its
                # role again, which a fence answers.
                ahead = None
                retries += 1
                log.debug("compute %s: step %d not ready: %s", address, step, exc)
                if retries >= MAX_CONSECUTIVE_CALL_ERRORS:
                    role, known = None, -1
            except FatalError:
                raise
            except Exception as exc:
                # A shard did not answer in time, or its worker is gone: survival detection decides
                # what happens to the step. An error that comes back every time ends the loop, and the
                # controller reports it.
                ahead = None
                stats.call_errors += 1
                stats.timeouts += isinstance(exc, TimeoutError)
                log.warning("compute %s: step %d failed (%s: %s)", address, step, type(exc).__name__, exc)
                if isinstance(exc, OSError):
                    # A shard's worker may be gone: the coordinator then suspends training until a
                    # standby takes its role (or every shard goes back to a checkpoint), and the next role
                    # says where it listens. Until then the same role comes back: ask again, waiting
                    # longer each time, for up to a call timeout (the controller has acted on a lost
                    # worker long before).
                    unreachable.append(time.monotonic())
                    if unreachable[-1] - unreachable[0] > timeout:
                        raise
                    time.sleep(min(1.0, 0.05 * 2 ** len(unreachable)))
                    resume = (role.generation, step)
                    role, known = None, -1
                    continue
                errors += 1
                if errors >= MAX_CONSECUTIVE_CALL_ERRORS:
                    raise
        return stats


def confirm(
    trainer: MicroBatchTrainer,
    role: Role,
    asked: BackupWanted,
    share: tuple[int, ...],
    shards: list[ShardLink],
) -> None:
    """A shard asks for ids of this loop's own share of a step whose push no shard refused: it holds this
    loop's copies of them aside (it had asked others for a backup of them, and they may have been computed
    on parameters a peer moved); none refused the push, so each shard took it before applying the step,
    and nothing this loop read had moved: it confirms them. (If that fails, it confirms when asked again.)"""
    own = [b for b in asked.batch_ids if b in share]
    if own:
        try:
            trainer.confirm(role, asked.step, own, shards)
        except (RecoverableError, OSError) as exc:
            log.debug("compute: confirming batch ids %s of step %d failed: %r", own, asked.step, exc)
