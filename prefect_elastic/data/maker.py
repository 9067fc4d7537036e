"""A compute worker's batches, made in a process of its own (`LocalBatches`), where the job's pipeline runs
on the compute workers (`data_pipeline`; by default where a user's code decodes or augments samples).

Why a process, as torch's DataLoader workers are: reading a sample of a user's Dataset seeds the process's
global random generators (`batches.seeded_sample`), which a micro-batch's forward draws from too (dropout,
under `GLOBAL_RNG_LOCK`): in a thread beside the loop, the two would have to take turns, and Python code of
a transform would hold the GIL while the step computes. In its own process the batch maker runs beside the
step on a core of its own, and what it draws never meets what the model draws. It is started with
`subprocess` rather than `multiprocessing`: a Dask worker started by a nanny is a daemonic process, which
`multiprocessing` forbids to have children.

The loop asks for the batch ids of its next step while this one computes (`want`), and takes them when the
step starts (`take`). The process reads its requests on stdin and answers on a pipe of its own (stdout is
pointed at stderr, where a user's `print` goes); it ends when its stdin closes, as when the loop's worker
dies. A batch maker that died (killed, out of memory) is started again, and its batches asked again: a
batch is a function of its id, whoever makes it.

    python -m prefect_elastic.data.maker    (started by `LocalBatches`; not a command for users)
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import IO, Any

from ..wire.signals import DataFailure, ModelFailure
from .fields import Batch

log = logging.getLogger(__name__)

__all__ = ["LocalBatches"]

_LENGTH = struct.Struct("<Q")
# Batch makers started again after they died, before the batch asked is said to fail.
RESTARTS = 3


def _send(out: IO[bytes], message: Any) -> None:
    body = pickle.dumps(message, protocol=5)
    out.write(_LENGTH.pack(len(body)) + body)
    out.flush()


def _receive(source: IO[bytes]) -> Any:
    head = source.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the other end closed")
    (size,) = _LENGTH.unpack(head)
    body = source.read(size)
    if len(body) < size:
        raise EOFError("the other end closed mid-message")
    return pickle.loads(body)


class _Maker:
    """One batch-maker process and the thread that reads its answers."""

    def __init__(self, spec: Any, futures: dict[int, Future[Batch]], lock: threading.Lock) -> None:
        env = dict(os.environ)
        # The loop's imports (the user's factory module, on the worker's path) must resolve there too.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prefect_elastic.data.maker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._in, self._out = self.process.stdin, self.process.stdout
        self._futures, self._lock = futures, lock
        self._sending = threading.Lock()  # (the async loop asks from its loop thread and its fetcher)
        self.alive = True
        _send(self._in, spec)
        self._reader = threading.Thread(target=self._read, name="prefect-elastic-batch-maker", daemon=True)
        self._reader.start()

    def ask(self, batch_id: int) -> None:
        try:
            with self._sending:
                _send(self._in, batch_id)
        except (BrokenPipeError, OSError, ValueError):
            self.alive = False

    def _read(self) -> None:
        try:
            while True:
                batch_id, made, failure = _receive(self._out)
                with self._lock:
                    future = self._futures.get(batch_id)
                if future is None or future.done():
                    continue  # (no longer wanted)
                if failure is not None:
                    future.set_exception(DataFailure(*failure))
                else:
                    future.set_result(made)
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        finally:
            self.alive = False

    def close(self) -> None:
        self.alive = False
        with contextlib.suppress(OSError, ValueError):
            self._in.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError, ValueError):
            self._out.close()


class LocalBatches:
    """The batches of this compute worker's batch ids, made ahead in a batch-maker process."""

    def __init__(self, spec: Any, timeout: float) -> None:
        self.spec = spec  # a `BatchSpec`
        self.timeout = timeout
        self._futures: dict[int, Future[Batch]] = {}
        self._lock = threading.Lock()
        self._maker: _Maker | None = None
        self.restarts = 0
        self.start()

    def _live(self) -> _Maker:
        if self._maker is not None and not self._maker.alive:
            log.warning("the batch maker (pid %d) ended; starting another", self._maker.process.pid)
            self._maker.close()
            self._maker = None
            self.restarts += 1
            with self._lock:
                lost = [b for b, f in self._futures.items() if not f.done()]
                for b in lost:
                    del self._futures[b]
            self.want(lost)
        if self._maker is None:
            self._maker = _Maker(self.spec, self._futures, self._lock)
        return self._maker

    def start(self) -> None:
        """Start the batch-maker process (when made, not at the first batch asked: its imports, torch and
        the user's Dataset, take a second or two, which a worker that joins a running job would otherwise
        spend in its first step while the others go on without it, made while the loop asks its role)."""
        self._live()

    def want(self, batch_ids: Iterable[int]) -> None:
        """Make these batch ids' batches, in this order, unless asked already."""
        for b in batch_ids:
            with self._lock:
                if b in self._futures:
                    continue
                self._futures[b] = Future()
            self._live().ask(b)

    def step(self, share: Iterable[int], following: Iterable[int]) -> dict[int, Batch]:
        """The batches of a step's `share`, the `following` step's asked for while this one computes."""
        share = list(share)
        if share:  # (a backup's share is of the step before the one the loop is at: kept)
            self._drop_before(self.spec.schedule.step_of(share[0]) - 1)
        self.want(share)
        self.want(following)
        return self.take(share)

    def take(self, batch_ids: Iterable[int]) -> dict[int, Batch]:
        """The batches of `batch_ids` (asked now where they were not), forgotten here once taken."""
        ids = list(batch_ids)
        self.want(ids)
        taken: dict[int, Batch] = {}
        for b in ids:
            taken[b] = self._result(b)
        return taken

    def _drop_before(self, step: int) -> None:
        """Forget the batches of steps before `step` that were asked and never taken: a sync loop went past
        them (the shards applied them from another member's backup), and would never take them now."""
        schedule = self.spec.schedule
        with self._lock:
            for b in [b for b in self._futures if schedule.step_of(b) < step]:
                self._futures.pop(b).cancel()

    def _result(self, batch_id: int) -> Batch:
        for _ in range(RESTARTS + 1):
            with self._lock:
                future = self._futures[batch_id]
            try:
                batch = future.result(timeout=self.timeout)
            except TimeoutError:
                if self._maker is not None and self._maker.alive:
                    raise
                self._live()  # (it died: asked again of a new one)
                continue
            with self._lock:
                self._futures.pop(batch_id, None)
            return batch
        step = self.spec.schedule.step_of(batch_id)
        # (This worker's fault, not the data's: a model's failure, which excludes the worker and makes the
        # batch on another.)
        raise ModelFailure(
            step,
            batch_id,
            f"the batch maker of this compute worker died {RESTARTS + 1} times making batch {batch_id} "
            "(killed, or out of memory: look at the worker's log for its output)",
        )

    def close(self) -> None:
        if self._maker is not None:
            self._maker.close()
            self._maker = None


def main() -> None:
    """The batch maker's process: a `BatchSpec`, then batch ids on stdin; their batches on its pipe."""
    import torch

    from .batches import BatchMaker

    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # (a user's print must not land in the answers)
    torch.set_num_threads(1)
    requests = sys.stdin.buffer
    spec = _receive(requests)
    maker = BatchMaker(spec)
    while True:
        try:
            batch_id = _receive(requests)
        except EOFError:
            return
        try:
            _send(answers, (batch_id, maker.make(batch_id), None))
        except DataFailure as failure:
            _send(answers, (batch_id, None, (failure.step, failure.batch_id, str(failure))))
        except Exception as exc:  # (a bug here, not the data's: said with the batch it was making)
            step = spec.schedule.step_of(batch_id)
            _send(answers, (batch_id, None, (step, batch_id, f"making batch {batch_id}: {exc!r}")))


if __name__ == "__main__":
    main()
