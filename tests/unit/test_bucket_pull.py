"""A sync step's parameters arriving bucket by bucket during forward (`ElasticJob.overlap_pull`), between a
compute loop's trainer and real data servers in this process, over real sockets: the parameters of the
whole pull bit for bit, step after step, with forward under way while later buckets are still to come;
and a shard that enters a new generation between two buckets of an answer refuses the rest, so the loop
drops the step as after a failed pull, and trains it again in the new generation to the same bits."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from prefect_elastic.compute import MicroBatchTrainer
from prefect_elastic.compute.bucket_pull import joined_now
from prefect_elastic.compute.stats import LoopStats
from prefect_elastic.data_server import DataServer
from prefect_elastic.errors import FatalError
from prefect_elastic.messages import Role, Tensors
from prefect_elastic.sharding import Piece
from prefect_elastic.training import prepare
from prefect_elastic.wire import Frame, ShardLink, unread_answers_dropped
from prefect_elastic.wire.signals import ModelFailure, StaleGenerationError

from ..conftest import in_process_servers, make_job
from .test_channel import Served

STEPS = 4
MODEL = "tests.models:wide_mlp"
CUT = 1  # the data server whose answer is cut: it holds all but one layer, in several buckets


def _cut_after_first_bucket(answer: Frame, server: DataServer) -> None:
    """Between the first and the second bucket of `answer`, `server` enters the next generation (what a
    fence does first, `DataServer.fence`: from then on it refuses the older generation's calls)."""
    assert answer.following is not None
    buckets = answer.following

    def cut() -> Iterator[Frame]:
        yield next(buckets)
        server.shard.generation += 1
        yield from buckets

    answer.following = cut()


class Run:
    """`STEPS` steps of one loop (`MODEL`, Adam, on two data servers), its parameters pulled in
    buckets where `pull`; with `cut_at`, shard `CUT`'s answer with the parameters of that step is cut by a new
    generation after its first bucket."""

    def __init__(
        self,
        digits_url: str,
        pull: bool,
        cut_at: int | None = None,
        fail: bool = False,
        model: str = MODEL,
        delay: float = 0.0,
    ) -> None:
        overrides = {"min_shard_bytes": 0, "overlap_push": True, "overlap_pull": pull}
        self.servers, plan = in_process_servers(digits_url, model=model, **overrides)
        prepared = prepare(make_job(digits_url, "reassign", model=model, **overrides))
        self.schedule = prepared.schedule
        cpu = torch.device("cpu")
        self.trainer = MicroBatchTrainer(prepared.specs.loop, plan, prepared.persistence.layout, cpu)
        self.cut_at = cut_at
        self.cuts = 0
        self.served = [Served(self._handler(i)) for i in range(len(self.servers))]
        self.links = [ShardLink(s.address, timeout=10) for s in self.served]
        self.stats = LoopStats("w")
        # Shard `CUT` writes the last bucket of each answer only once the loop's first layer ran forward on
        # the buckets before it (`_last_held`): a forward that waited for every bucket would never start.
        self.first_layer_ran = threading.Event()
        self.held: list[bool] = []  # per answer: whether the first layer ran before its last bucket left
        self.model = model
        self.delay = delay  # seconds each bucket frame waits at the shard before it is written
        if model == MODEL:
            self.trainer.model[1].register_forward_hook(lambda *_: self._note_first_layer())
        # With `fail`: the first layer's forward raises once, at the first step pulled in buckets,
        # before its buckets are in (this hook runs before the gate's), while the threads still read them.
        self.fail, self.model_failures = fail, 0
        self.stale_from_pull: list[bool] = []  # per stale-generation refusal: whether the pull's own
        if model == MODEL:
            self.trainer.model[1].register_forward_pre_hook(lambda *_: self._fail_once())

    def _handler(self, i: int):  # type: ignore[no-untyped-def]
        server = self.servers[i]

        async def handle(frame: Frame) -> Frame:
            answer = await server.on_frame(frame)
            then = frame.header.get("then") or {}
            if (
                answer.following is not None
                and i == CUT
                and then.get("step") == self.cut_at
                and not self.cuts
            ):
                self.cuts += 1
                _cut_after_first_bucket(answer, server)
            elif (
                answer.following is not None
                and i == CUT
                and self.cut_at is None
                and self.model == MODEL
                and then["step"] < STEPS
            ):
                answer.following = self._last_held(answer.following, int(answer.header["follow"]))
            if answer.following is not None and self.delay:
                answer.following = self._delayed(answer.following)
            return answer

        return handle

    def _last_held(self, buckets: Iterator[Frame], count: int) -> Iterator[Frame]:
        for k, frame in enumerate(buckets):
            if k == count - 1:
                # (This blocks the shard's event loop, as a slow link would hold the bytes back.)
                self.held.append(self.first_layer_ran.wait(10))
                self.first_layer_ran.clear()
            yield frame

    def _delayed(self, buckets: Iterator[Frame]) -> Iterator[Frame]:
        for frame in buckets:
            time.sleep(self.delay)  # (blocks the shard's event loop: a slow link)
            yield frame

    def _fail_once(self) -> None:
        pull = self.trainer.bucket_pull
        if self.fail and not self.model_failures and pull is not None and pull.owed:
            # (Shard `CUT`'s last bucket is held until now: it is still to be read.)
            self.first_layer_ran.set()
            raise RuntimeError("a layer that fails once")

    def _note_first_layer(self) -> None:
        pull = self.trainer.bucket_pull
        if (
            pull is not None and pull.owed and (not self.fail or self.model_failures)
        ):  # (the first forward, buckets coming)
            self.first_layer_ran.set()

    def fence(self, generation: int) -> None:
        for server, served in zip(self.servers, self.served, strict=True):
            asyncio.run_coroutine_threadsafe(server.fence(generation), served.loop).result(10)

    def train(self) -> Tensors:
        role = Role(0, 0, ("w",), 0, channels=tuple(s.address for s in self.served))
        ahead = None
        step = 0
        try:
            while step < STEPS:
                share = self.schedule.share(step, 0, 1)
                try:
                    # (As the loop calls it: a failed step closes the links that still owe answers.)
                    with unread_answers_dropped(self.links):
                        ahead = self.trainer.step(
                            role, step, share, self.links, self.schedule, self.stats, ahead
                        )
                except StaleGenerationError as exc:
                    pull = self.trainer.bucket_pull
                    self.stale_from_pull.append(pull is not None and exc is pull.failure)
                    # (The loop drops the step and asks for its role again: the coordinator fences every
                    # shard into the new generation and gives it one, from the step the shards are at.)
                    self.fence(1)
                    role = Role(1, 0, ("w",), step, channels=role.channels)
                    ahead = None
                    continue
                except ModelFailure:
                    # (A real loop reports it and the job ends; here the step is tried again, to show
                    # that the failure left no bucket owed on any connection.)
                    self.model_failures += 1
                    ahead = None
                    continue
                step += 1
            state, _ = self.trainer.fetch(role, STEPS, self.links, self.schedule).unpack(self.trainer.shapes)
            return {n: t.clone() for n, t in state.items()}
        finally:
            self.trainer.close()
            for link in self.links:
                link.close()
            for s in self.served:
                s.close()


def test_parameters_pulled_in_buckets_during_forward_are_the_whole_pulls(digits_url: str) -> None:
    whole = Run(digits_url, pull=False)
    expected = whole.train()
    assert whole.trainer.bucket_pull is None and whole.stats.pulled == 0

    run = Run(digits_url, pull=True)
    plan = run.trainer.bucket_pull.plan if run.trainer.bucket_pull else []
    assert max(len(buckets) for buckets in plan) >= 3, "a shard of several buckets"
    got = run.train()
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected), "the bits of the whole pull"
    per_step = sum(len(buckets) for buckets in plan)
    # Every step after the first read its parameters in buckets (the first is fetched whole).
    assert run.stats.pulled == (STEPS - 1) * per_step
    # ... and its first layer ran forward before the last bucket had even left the shard.
    assert run.held == [True] * (STEPS - 1)


@pytest.mark.parametrize("cut_at", [1, 2])
def test_a_bucket_of_an_answer_cut_by_a_new_generation_is_refused_and_the_step_trained_again(
    digits_url: str, cut_at: int
) -> None:
    expected = Run(digits_url, pull=False).train()
    run = Run(digits_url, pull=True, cut_at=cut_at)
    got = run.train()
    assert run.cuts == 1
    # The loop read shard `CUT`'s first bucket, then the refusal in place of the rest: a stale generation,
    # raised in the forward's gate as the wire's error (not the model's), and nothing left unread.
    assert run.stale_from_pull == [True]
    assert all(torch.equal(got[n], expected[n]) for n in expected), "the step trained again, same bits"


def test_a_model_error_while_buckets_are_still_read_leaves_no_connection_owing_one(digits_url: str) -> None:
    """A forward that raises with buckets of its step still being read: the readers are stopped, the
    connections that owed buckets closed, and the step trained again from a fresh pull to the same bits."""
    expected = Run(digits_url, pull=False).train()
    run = Run(digits_url, pull=True, fail=True)
    got = run.train()
    assert run.model_failures == 1 and run.held[0], "the layer failed before the last bucket left the shard"
    assert all(torch.equal(got[n], expected[n]) for n in expected), "the step trained again, same bits"


@pytest.mark.parametrize(
    ("model", "reads"),
    [("tests.models:tied_dropout", {}), ("tests.models:reads_child_weight", {"proj.weight": ""})],
)
def test_a_parameter_read_before_its_own_module_runs_is_waited_for_by_the_module_that_reads_it(
    digits_url: str, model: str, reads: dict[str, str]
) -> None:
    """Tied weights, each use inside a module of its own, need nothing more; a parent that reads its
    child's weight (a bucket of its own) before the child runs waits for it in its own pre-hook (found on
    the meta model). Each bucket is held back a moment at the shard, so a forward that read a parameter
    before its bucket came would compute on the step before's: the whole pull's bits say it did not."""
    expected = Run(digits_url, pull=False, model=model).train()
    run = Run(digits_url, pull=True, model=model, delay=0.05)
    got = run.train()
    assert run.trainer.guarded and run.trainer.early_reads == reads
    assert run.stats.pulled > 0
    assert all(torch.equal(got[n], expected[n]) for n in expected), "the bits of the whole pull"


def test_the_meta_forward_that_finds_early_reads_leaves_the_models_own_state_alone(digits_url: str) -> None:
    """The check runs the model's forward once on the meta device, on a copy: a model that counts its
    forward calls (the tests' gates do, to wait in a given micro-batch) counts only those of training."""
    run = Run(digits_url, pull=True, model="tests.models:second_forward_gated_mlp")
    run.train()
    assert run.trainer.guarded and run.stats.pulled > 0
    assert run.trainer.model.calls == STEPS * len(run.schedule.share(0, 0, 1))


def test_a_tensor_split_across_shards_is_joined_into_the_same_tensor_every_step() -> None:
    """Whole in a tensor kept from step to step (a fresh one over 32 MB is mapped afresh each step, and
    its page faults cost more than the copy), with each step's values, its version counter unmoved (the
    trainer's check for a model that changes its parameters in place reads it); a new one where the shape
    changed; pieces that do not cover the tensor are refused."""
    shape = torch.Size([4, 6])
    pieces = [Piece("w", 0, 10, 24), Piece("w", 10, 24, 24)]
    held: dict[str, tuple[torch.Tensor, Any]] = {}
    seen = []
    for step in range(3):
        whole = torch.arange(24, dtype=torch.float32).reshape(shape) + 100 * step
        runs = [
            (shard, piece, whole.reshape(-1)[piece.start : piece.stop].clone())
            for shard, piece in enumerate(pieces)
        ]
        joined = joined_now(held, "w", shape, runs)
        assert torch.equal(joined, whole) and joined._version == 0
        seen.append(joined)
    assert seen[0] is seen[1] is seen[2], "one tensor, step after step"
    other = torch.Size([2, 12])
    assert joined_now(held, "w", other, [(0, Piece("w", 0, 24, 24), torch.zeros(24))]).shape == other
    with pytest.raises(FatalError, match="do not cover"):
        joined_now(held, "w", shape, [(0, pieces[0], torch.zeros(10))])
