"""The compute loop in async mode (`AsyncLoop`): a session per generation (`async_session.py`), until the
job ends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..errors import FatalError
from ..wire.signals import ModelFailure, RecoverableError, StaleGenerationError
from .async_session import AsyncSession
from .loop import LoopContext, ask_role, reconnect
from .stats import LoopStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncLoop:
    """The `Loop` of async mode. Errors are treated as in sync mode (`SyncLoop`): a stale generation asks
    for the role again; a model that fails is reported; a shard that cannot be reached is waited for (up
    to a call timeout), since survival detection acts on a lost static worker."""

    def run(self, context: LoopContext) -> LoopStats:
        address, coordinator, trainer = context.address, context.coordinator, context.trainer
        schedule, stats, timeout, wanted = context.schedule, context.stats, context.timeout, context.wanted
        shards, data = context.shards, context.data
        spec = trainer.spec
        known = -1
        errors = 0
        unreachable: list[float] = []
        # The first optimizer a process builds and steps imports much of torch (about a second): pay it now,
        # not in the first candidate step.
        warm = torch.zeros(1, requires_grad=True)
        warm.grad = torch.zeros(1)
        spec.model_spec.build_optimizer([warm]).step()
        while wanted():
            role, errors = ask_role(coordinator, address, known, stats, spec, errors)
            if role is None:
                continue
            if role.stop:
                break
            reconnect(shards, role.channels, timeout)
            reconnect(data, role.channels, timeout)
            known = role.generation
            session = AsyncSession(
                role, address, coordinator, trainer, schedule, shards, data, stats, timeout
            )
            trained = stats.steps
            try:
                if session.run(wanted):
                    break
                errors = 0
            except ModelFailure as failure:
                coordinator.report_failure(
                    role.generation, address, failure.step, failure.batch_id, failure.kind, str(failure)
                ).result(timeout=timeout)
            except StaleGenerationError as exc:
                stats.stale += 1
                log.debug("compute %s: generation %d ended: %s", address, role.generation, exc)
            except FatalError:
                raise
            except (RecoverableError, OSError) as exc:
                # A shard not reachable (its worker may be gone: survival detection acts on it) or a call that
                # failed: start the generation's session again, after a pause that grows, for up to a call
                # timeout.
                stats.call_errors += 1
                stats.timeouts += isinstance(exc, TimeoutError)
                log.warning("compute %s: async step failed (%s: %s)", address, type(exc).__name__, exc)
                if stats.steps > trained:
                    unreachable.clear()  # (as in sync mode: the failures since the last step count)
                unreachable.append(time.monotonic())
                if unreachable[-1] - unreachable[0] > timeout:
                    raise
                time.sleep(min(1.0, 0.05 * 2 ** len(unreachable)))
                known = -1
            finally:
                session.close()
                for link in (*shards, *data):
                    if link.pending:
                        link.close()  # answers left unread: the next session starts on clean connections
        return stats
