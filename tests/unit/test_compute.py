"""The compute worker without a cluster: the gradient of one micro-batch, the loop of each mode, a sync
step's two push paths against real data servers, and the registry of the loops' connections."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from prefect_elastic import ElasticJob
from prefect_elastic.compute import (
    LoopStats,
    MicroBatchTrainer,
    Pipelined,
    ShardByShard,
    dask_profiler_paused,
    leave_links,
    micro_batch_seed,
    moved_as_one,
    push_order,
    pushes_for,
    training_device,
)
from prefect_elastic.compute.links import registered
from prefect_elastic.messages import Role, Tensors
from prefect_elastic.training import prepare
from prefect_elastic.wire import ChannelAddress, Frame, ShardLink

from ..conftest import in_process_servers, make_job
from ..models import TOKENS
from .test_channel import Served


def test_gradient_equals_an_ordinary_model_with_tied_weights_and_dropout(digits_url: str) -> None:
    job = ElasticJob(model="tests.models:tied_dropout", dataset=digits_url, data_servers=4, seed=3)
    layout, tensors = job.initial_tensors()
    trainer = MicroBatchTrainer(job.loop_spec, [list(tensors)], layout, torch.device("cpu"))
    params = {n: tensors[n].clone().requires_grad_(True) for n in trainer.param_names}
    buffers = {n: t for n, t in tensors.items() if n not in params}
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))

    loss, grads, _ = trainer.gradient(params, buffers, {"x": x, "y": y}, step=0, batch_id=5)
    again, _, _ = trainer.gradient(params, buffers, {"x": x, "y": y}, step=0, batch_id=5)
    other, _, _ = trainer.gradient(params, buffers, {"x": x, "y": y}, step=0, batch_id=6)
    assert loss == again, "the same batch id draws the same dropout mask"
    assert loss != other, "another batch id draws another"

    ordinary = job.initial_model()
    torch.manual_seed(micro_batch_seed(job.seed, 5))
    torch.nn.functional.cross_entropy(ordinary(x), y).backward()
    for name, p in ordinary.named_parameters():  # the tied weight appears once, with both uses summed
        assert torch.equal(grads[name], p.grad), name
    assert set(grads) == set(layout.params)


def test_gradient_equals_an_ordinary_language_model_with_an_lstm(tokens_url: str) -> None:
    """Token inputs, an LSTM (whose weights torch keeps as one flat buffer), an embedding tied to the
    output layer and a loss of the user's own: the trainer's gradient is the ordinary model's."""
    job = ElasticJob(
        model="tests.models:char_lm", loss="tests.models:sequence_loss", dataset=tokens_url, seed=4
    )
    layout, tensors = job.initial_tensors()
    trainer = MicroBatchTrainer(job.loop_spec, [list(tensors)], layout, torch.device("cpu"))
    params = {n: tensors[n].clone().requires_grad_(True) for n in trainer.param_names}
    x = torch.randint(1, TOKENS, (8, 16))
    y = torch.randint(1, TOKENS, (8, 16))

    loss, grads, _ = trainer.gradient(params, {}, {"x": x, "y": y}, step=0, batch_id=2)

    ordinary = job.initial_model()
    torch.manual_seed(micro_batch_seed(job.seed, 2))
    expected = job.loss_fn()(ordinary(x), y)
    expected.backward()
    assert loss == expected.item()
    for name, p in ordinary.named_parameters():  # out.weight is embed.weight, its gradient both uses
        assert torch.equal(grads[name], p.grad), name
    assert "out.weight" not in grads and set(grads) == set(layout.params)


def test_a_micro_batch_draws_its_dropout_mask_alone_while_another_thread_builds_a_model(
    digits_url: str,
) -> None:
    """A worker process can run two jobs' loops, and build models, in threads of its own; all of them seed
    and draw from torch's one global generator. A micro-batch's forward holds the lock that model builds
    hold, so a build started while it runs waits, and both get what they get alone. (Without it, the
    forward's dropout drew from the other job's freshly seeded stream, and the other job's second layer
    from what the forward left.)"""
    from ..models import FORWARD_PAUSED, PAUSE_IN_CONSTRUCTOR, PAUSE_IN_FORWARD, PAUSED

    job = ElasticJob(model="tests.models:pausing_dropout", dataset=digits_url, seed=3)
    other = ElasticJob(model="tests.models:pausing_mlp", dataset=digits_url, seed=6)
    layout, tensors = job.initial_tensors()
    trainer = MicroBatchTrainer(job.loop_spec, [list(tensors)], layout, torch.device("cpu"))
    params = {n: tensors[n].clone().requires_grad_(True) for n in trainer.param_names}
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    alone_loss, alone_grads, _ = trainer.gradient(params, {}, {"x": x, "y": y}, step=0, batch_id=5)
    _, other_alone = other.initial_tensors()
    built: list[dict[str, torch.Tensor]] = []

    def build_the_other_while_the_forward_runs() -> None:
        FORWARD_PAUSED.wait(10)
        built.append(other.initial_tensors()[1])  # pauses between its two layers' draws

    PAUSE_IN_FORWARD.set()
    PAUSE_IN_CONSTRUCTOR.set()
    thread = threading.Thread(target=build_the_other_while_the_forward_runs)
    thread.start()
    try:
        loss, grads, _ = trainer.gradient(params, {}, {"x": x, "y": y}, step=0, batch_id=5)
    finally:
        PAUSE_IN_FORWARD.clear()
        thread.join(30)
        PAUSE_IN_CONSTRUCTOR.clear()
        PAUSED.clear()
        FORWARD_PAUSED.clear()
    assert len(built) == 1
    assert loss == alone_loss, "the micro-batch drew the dropout mask it draws alone"
    assert all(torch.equal(grads[n], alone_grads[n]) for n in alone_grads)
    assert all(torch.equal(built[0][n], other_alone[n]) for n in other_alone), "the other model as alone"


def test_a_step_is_pushed_first_to_the_shards_that_hold_the_most_parameters(digits_url: str) -> None:
    assert push_order([0, 40_000]) == [1, 0]
    assert push_order([5, 0, 5, 9]) == [3, 0, 2, 1], "ties keep the shards' order"
    # A small model's parameters all on the last data server (`plan_shards`): its frame goes first.
    job = ElasticJob(model="tests.models:tied_dropout", dataset=digits_url, data_servers=3, seed=3)
    layout, tensors = job.initial_tensors()
    trainer = MicroBatchTrainer(job.loop_spec, [[], [], list(tensors)], layout, torch.device("cpu"))
    assert trainer.push_order == [2, 0, 1]


def test_a_worker_without_a_gpu_trains_on_the_cpu_with_torchs_settings_left_alone() -> None:
    """Deterministic kernels are for CUDA (`training_device`; checked on a lent GPU by benchmarks/gpu.py,
    docs/benchmarks.md "On a GPU"): a CPU worker's kernels give the same bits anyway, and the global
    setting would slow every process that imports prefect-elastic."""
    assert not torch.cuda.is_available(), "this test is about a machine without a GPU"
    deterministic = torch.are_deterministic_algorithms_enabled()
    assert training_device() == torch.device("cpu")
    assert torch.are_deterministic_algorithms_enabled() == deterministic


def test_the_jobs_deterministic_setting_chooses_the_gpu_kernels(
    monkeypatch: pytest.MonkeyPatch, digits_url: str
) -> None:
    """`ElasticJob.deterministic` reaches the loop (`LoopSpec`) and sets torch's flags on a GPU worker.
    A fake GPU (`torch.cuda.is_available` patched: no GPU here): only the flags are read, nothing runs on
    CUDA; the kernels themselves are tried on a lent GPU (benchmarks/gpu.py)."""
    job = ElasticJob(job_id="fast", model="tests.models:mlp", dataset=digits_url, deterministic=False)
    assert job.loop_spec.deterministic is False and ElasticJob.model_fields["deterministic"].default is True
    flags = (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.are_deterministic_algorithms_enabled(),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        assert training_device(job.loop_spec.deterministic) == torch.device("cuda")
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
        assert not torch.are_deterministic_algorithms_enabled()
        training_device(True)
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags[0], flags[1]
        torch.use_deterministic_algorithms(flags[2])


def test_parameters_moved_as_one_transfer_give_the_same_gradients(digits_url: str) -> None:
    """On a GPU the parameters go in, and the gradients come out, as views of one flat tensor each way
    (`on_device`, `to_host`); the same function on the CPU gives every tensor its own values and shape,
    and the gradient against those views is the gradient against the separate tensors."""
    job = ElasticJob(model="tests.models:tied_dropout", dataset=digits_url, seed=3)
    layout, tensors = job.initial_tensors()
    trainer = MicroBatchTrainer(job.loop_spec, [list(tensors)], layout, torch.device("cpu"))
    names = trainer.param_names
    moved = moved_as_one(names, [tensors[n] for n in names], trainer.shapes, torch.device("cpu"))
    assert list(moved) == names
    assert all(torch.equal(moved[n], tensors[n]) for n in names)
    assert len({t.untyped_storage().data_ptr() for t in moved.values()}) == 1, "one flat tensor"

    buffers = {n: t for n, t in tensors.items() if n not in names}
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    separate = {n: tensors[n].clone().requires_grad_(True) for n in names}
    views = {n: t.requires_grad_(True) for n, t in moved.items()}
    loss, expected, _ = trainer.gradient(separate, buffers, {"x": x, "y": y}, step=0, batch_id=5)
    again, got, _ = trainer.gradient(views, buffers, {"x": x, "y": y}, step=0, batch_id=5)
    assert loss == again
    assert all(torch.equal(got[n], expected[n]) for n in names)
    back = moved_as_one(names, [expected[n] for n in names], trainer.shapes, torch.device("cpu"))
    assert all(torch.equal(back[n], expected[n]) for n in names), "and the gradients come back as they were"


class _Callback:
    """A periodic callback's running state (tornado's `PeriodicCallback` needs an event loop)."""

    def __init__(self) -> None:
        self.running = True

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def is_running(self) -> bool:
        return self.running


class _Worker:
    """What `dask_profiler_paused` uses of a Dask worker; its event loop runs the queued calls when told."""

    def __init__(self) -> None:
        names = ("profile", "profile-cycle", "heartbeat")
        self.periodic_callbacks = {name: _Callback() for name in names}
        self.status = SimpleNamespace(name="running")
        self.queued: list[Callable[[], None]] = []
        self.loop = SimpleNamespace(add_callback=lambda fn, *args: self.queued.append(lambda: fn(*args)))

    def profiling(self) -> list[bool]:
        return [self.periodic_callbacks[k].is_running() for k in ("profile", "profile-cycle")]


def test_the_profiler_stays_paused_while_any_loop_runs_whatever_order_their_calls_arrive_in() -> None:
    worker = _Worker()
    first, second = dask_profiler_paused(worker), dask_profiler_paused(worker)
    first.__enter__()
    for run in worker.queued:
        run()
    assert worker.profiling() == [False, False]
    assert worker.periodic_callbacks["heartbeat"].is_running()
    # One loop ends while another starts; their calls reach the event loop in the opposite order.
    worker.queued.clear()
    first.__exit__(None, None, None)
    second.__enter__()
    for run in reversed(worker.queued):
        run()
    assert worker.profiling() == [False, False]
    second.__exit__(None, None, None)
    for run in worker.queued:
        run()
    assert worker.profiling() == [True, True]


def test_the_profiler_is_not_started_again_on_a_worker_that_is_closing() -> None:
    worker = _Worker()
    with dask_profiler_paused(worker):
        for run in worker.queued:
            run()
        worker.queued.clear()
        worker.status.name = "closing"  # (`Worker.close` stops every periodic callback itself)
    for run in worker.queued:
        run()
    assert worker.profiling() == [False, False]


class _ObservesPushes:
    """A `PushObserver` that waits, after each push, until that shard has applied the step, and notes
    the shard's version then."""

    def __init__(self, versions: Callable[[int], int]) -> None:
        self.versions = versions
        self.seen: list[tuple[int, int, int]] = []

    def after_push(self, shard: int, step: int, wait_applied: Callable[[], None]) -> None:
        wait_applied()
        self.seen.append((shard, step, self.versions(shard)))


def _one_step(digits_url: str, observer: _ObservesPushes | None) -> tuple[Tensors, list[int], object]:
    """Step 0 of a one-member generation on two real data servers, pushed as a loop with `observer` on
    its worker would; returns the parameters of step 1, the servers' versions, and what the step gave."""
    servers, plan = in_process_servers(digits_url, min_shard_bytes=0)
    assert all(plan), "both data servers hold parameters"
    prepared = prepare(make_job(digits_url, "reassign", model="tests.models:mlp", min_shard_bytes=0))
    schedule = prepared.schedule
    trainer = MicroBatchTrainer(prepared.specs.loop, plan, prepared.persistence.layout, torch.device("cpu"))
    served = [Served(server.on_frame) for server in servers]
    links = [ShardLink(s.address, timeout=5) for s in served]
    role = Role(0, 0, ("w",), 0, channels=tuple(s.address for s in served))
    pushes = Pipelined() if observer is None else ShardByShard(observer)
    if observer is not None:
        observer.versions = lambda i: servers[i].version
    try:
        share = schedule.share(0, role.rank, role.size)
        ahead = trainer.step(role, 0, share, links, schedule, LoopStats("w"), None, pushes)
        state, _ = trainer.fetch(role, 1, links, schedule).unpack(trainer.shapes)
        return {n: t.clone() for n, t in state.items()}, [server.version for server in servers], ahead
    finally:
        for link in links:
            link.close()
        for s in served:
            s.close()


def test_a_step_pushed_shard_by_shard_to_an_observer_applies_as_the_pipelined_step(digits_url: str) -> None:
    """A worker with a push observer (`KillBetweenPushes`) pushes to one shard at a time and tells the
    observer after each, whose wait returns once that shard has applied the step; the shards end as a
    pipelined step leaves them, bit for bit. Only the pipelined push asks for the next step's answers."""
    assert isinstance(pushes_for(None), Pipelined)
    observer = _ObservesPushes(lambda i: -1)
    assert pushes_for(observer) == ShardByShard(observer)
    observed, versions, ahead = _one_step(digits_url, observer)
    assert observer.seen == [(0, 0, 1), (1, 0, 1)], "shard 0 had applied step 0 before shard 1's push"
    assert versions == [1, 1] and ahead is None
    pipelined, versions, ahead = _one_step(digits_url, None)
    assert versions == [1, 1] and ahead is not None
    assert set(observed) == set(pipelined)
    assert all(torch.equal(observed[n], pipelined[n]) for n in pipelined)


def test_leave_links_wakes_a_loop_blocked_on_a_moved_shard_and_no_other_connection() -> None:
    """A frozen static worker's kernel keeps its connections open: `leave_links` breaks the connections
    of the job's loops to the shards that moved, so a loop blocked on one asks for its role again."""
    heard = threading.Event()

    async def never_answers(frame: Frame) -> Frame:
        heard.set()
        await asyncio.sleep(60)
        return frame

    frozen = Served(never_answers)
    moved = frozen.address
    elsewhere = ChannelAddress("127.0.0.1", 1)
    shards = [ShardLink(moved, timeout=60), ShardLink(elsewhere, 60)]
    data: list[ShardLink] = []  # (a sync loop's: empty)
    other_job = [ShardLink(moved, 60)]
    failed: list[BaseException] = []

    def blocked_loop() -> None:
        try:
            shards[0].request(Frame({"op": "pull"}))
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=blocked_loop)
    try:
        with registered("a", shards, data), registered("b", other_job):
            thread.start()
            assert heard.wait(30), "the loop's frame reached the shard"
            assert leave_links("a", [("127.0.0.1", 9)]) == 0
            assert leave_links("a", [tuple(moved)]) == 1, "not the other job's connection to it"
            thread.join(30)
            assert not thread.is_alive() and isinstance(failed[0], OSError), "the loop woke"
        assert leave_links("a", [tuple(moved)]) == 0, "a loop that ended is forgotten"
    finally:
        for link in (*shards, *other_job):
            link.interrupt()
            link.close()
        thread.join(30)
        frozen.close()
