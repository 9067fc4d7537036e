"""Compute workers excluded after their model failed, as a pure decision: like Horovod's host blacklist, a
worker whose model raised (or whose loss was not finite) on a batch trains no more for this job, and the
batch trains again on another worker. The job fails only when the same batch failed on two workers (the
model or the data is at fault, not a node), or when no member is left that was not excluded.

`CoordinatorState.model_failed` records the events; the survival check after it takes the excluded
worker's share away.
"""

from __future__ import annotations

from collections.abc import Iterable

from .record import Failure


class Exclusions:
    def __init__(self) -> None:
        self.excluded: dict[str, str] = {}  # worker -> why
        self._failed_on: dict[int, dict[str, str]] = {}  # batch id (-1: none named) -> worker -> why

    def model_failed(self, worker: str, step: int, batch_id: int | None, message: str) -> Failure | None:
        """`worker`'s model failed on `batch_id` of `step`: the job's failure when that batch failed on
        another worker too (or no batch is named: the whole step failed), else None, and the worker is
        excluded."""
        failed_on = self._failed_on.setdefault(-1 if batch_id is None else batch_id, {})
        failed_on[worker] = message
        if batch_id is None or len(failed_on) > 1:
            where = ", ".join(sorted(failed_on))
            why = "; ".join(f"on {w}: {m}" for w, m in sorted(failed_on.items()))
            what = f"batch {batch_id} of step {step}" if batch_id is not None else f"step {step}"
            return Failure(
                "model",
                f"{what} failed on {len(failed_on)} workers ({where}), so the model or the data is at "
                f"fault, not a node: {why}",
                step,
                batch_id,
            )
        self.excluded[worker] = message
        return None

    def none_left(self, members: Iterable[str], step: int, batch_id: int | None) -> Failure | None:
        """The job's failure when every member was excluded, else None."""
        if not all(m in self.excluded for m in members):
            return None
        excluded = "; ".join(f"{w}: {m}" for w, m in sorted(self.excluded.items()))
        return Failure(
            "model",
            f"every compute worker was excluded after its model failed ({excluded}); the last "
            f"failure was at step {step}, batch {batch_id}",
            step,
            batch_id,
        )
