"""Shared fixtures: the digits dataset, real local clusters, one-worker reference runs, and `make_job`.

Cluster tests start real scheduler and worker processes (`LocalElasticCluster`) and kill them with real
signals. A reference run is the same job trained with one compute worker and no faults; invariant 1
says every faulty run must end with parameters bitwise equal to it.

The signal files of `tests.models` (`GATE`, `FAIL_ONCE`, `HOLD`) live in a folder made fresh for each
test session and named in the environment here, at import, before any test module imports `tests.models`
and before any cluster starts: the worker processes inherit the environment, and two test runs on one
machine never share a file.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import prefect_elastic
import prefect_elastic.training
from prefect_elastic import ElasticJob, TrainResult, train
from prefect_elastic.compute.pushes import PUSH_HOOK
from prefect_elastic.data_server import DataServer, plan_shards
from prefect_elastic.dataset import digits_dataset, write_npz
from prefect_elastic.errors import ElasticError
from prefect_elastic.local.chaos import SoakFigures
from prefect_elastic.local.cluster import LocalElasticCluster
from prefect_elastic.local.faults import FaultSchedule
from prefect_elastic.local.forkserver import FORK_SERVER_ENV
from prefect_elastic.local.push_faults import KillBetweenPushes
from prefect_elastic.messages import Progress
from prefect_elastic.training import prepare
from prefect_elastic.wire import memfd

from .prefect_harness import prefect_server  # noqa: F401  (a session fixture: a real Prefect server)


def _public_errors_only(train_: Callable[..., TrainResult]) -> Callable[..., TrainResult]:
    """`train` as every test calls it: whatever a run meets (kills, freezes, partitions, a lost scheduler, a
    bad job), what it raises must be one of the public errors of `prefect_elastic.errors`; any other
    exception fails the test that met it, naming it."""

    @functools.wraps(train_)
    def train(*args: Any, **kwargs: Any) -> TrainResult:
        try:
            return train_(*args, **kwargs)
        except ElasticError:
            raise
        except Exception as exc:
            raise AssertionError(f"train() raised {type(exc).__name__}, not a public error: {exc}") from exc

    return train


# (Before any test module imports `train`: they all get the guarded one.)
train = _public_errors_only(train)
prefect_elastic.train = prefect_elastic.training.train = train  # type: ignore[attr-defined]

# The variable names are repeated in tests/models.py, which worker processes import without this file.
_SIGNALS = Path(tempfile.mkdtemp(prefix="prefect-elastic-tests-"))
os.environ["ELASTIC_TESTS_GATE"] = str(_SIGNALS / "gate")
os.environ["ELASTIC_TESTS_FAIL_ONCE"] = str(_SIGNALS / "fail-once")
os.environ["ELASTIC_TESTS_HOLD"] = str(_SIGNALS / "hold")
os.environ["ELASTIC_TESTS_BAD_WORKER"] = str(_SIGNALS / "bad-worker")
# The local clusters of the tests (and of the flows they run in subprocesses) fork their workers from one
# process that imported distributed, torch and this package once (`prefect_elastic.local.forkserver`): each
# of the suite's hundreds of worker processes starts with a fifth of the CPU. The tests of what a user meets
# start theirs with the `dask` command line (tests/test_user_cluster.py, tests/test_slurm.py); set the
# variable to 0 to run everything on plainly started processes.
os.environ.setdefault(FORK_SERVER_ENV, "1")


def train_killed_between_pushes(
    cluster: LocalElasticCluster, job: ElasticJob, target: str, at_step: int = 8
) -> TrainResult:
    """`job` trained on `cluster` with worker `target` SIGKILLed after its push to shard 0 of a step from
    `at_step` on, before its push to shard 1 (`KillBetweenPushes`)."""
    with cluster.client() as client:
        client.register_plugin(KillBetweenPushes(target, at_step=at_step), name=PUSH_HOOK)
        try:
            return train(job, cluster=cluster)
        finally:
            client.unregister_worker_plugin(PUSH_HOOK)


@contextlib.contextmanager
def held_training() -> Iterator[None]:
    """Arm the hold of `tests.models:held_mlp`: training stands at a step of at least 4 from its 9th
    forward pass on until the block ends, so a test places a fault (a kill, a failure, a cancel) at a
    standing job, never in a race with a job that may already be over."""
    from .models import GATE, HOLD

    HOLD.touch()
    try:
        yield
    finally:
        HOLD.unlink(missing_ok=True)
        GATE.unlink(missing_ok=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SIGNALS, ignore_errors=True)


# The seed of the tests that rotate over their cases from one CI run to the next (which chaos soak, which
# benchmark group): `ELASTIC_CI_SEED` repeats a run's choices; without it each session draws one.
CI_SEED = int(os.environ.get("ELASTIC_CI_SEED") or random.SystemRandom().randrange(10_000))


def rotated(cases: list[Any], salt: int = 0) -> Any:
    """The one of `cases` this session runs: the seed picks it, so successive CI runs go round them all."""
    return cases[(CI_SEED + salt) % len(cases)]


def pytest_report_header() -> str:
    return (
        f"ELASTIC_CI_SEED={CI_SEED} (set it to repeat this run's soak, benchmark group and rotated cases; "
        "ELASTIC_ALL_CASES=1 runs every case)"
    )


# The figures of each chaos soak run of this session (tests/test_chaos.py), printed at the end of the output.
SOAK_FIGURES: list[SoakFigures] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SOAK_FIGURES:
        terminalreporter.section("chaos soak")
        for figures in SOAK_FIGURES:
            terminalreporter.write_line(figures.summary())


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--screenshots",
        metavar="DIR",
        help="write the Prefect UI screenshots of tests/test_ui.py into DIR (scripts/screenshots.sh gives "
        "docs/img); by default they go to the test's temporary folder, so no test writes a tracked file",
    )


@pytest.fixture
def screenshots(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Where a test saves screenshots: the folder of --screenshots, or a temporary one."""
    given = request.config.getoption("--screenshots")
    folder = Path(given).resolve() if given else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


logging.getLogger("prefect_elastic").setLevel(logging.INFO)


@pytest.fixture(scope="session")
def digits_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return digits_dataset(str(tmp_path_factory.mktemp("digits")), shards=3)


@pytest.fixture(scope="session")
def tokens_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Sequences of token ids, as a language model's data: x int64 (N, 16), y the next token of each
    position (x shifted by one), in 2 .npz files; `tests.models:char_lm` reads them."""
    from .models import TOKENS  # (not at the top: on import it reads the gate variables set after them)

    folder = tmp_path_factory.mktemp("tokens")
    text = np.random.default_rng(0).integers(1, TOKENS, size=(512, 17), dtype=np.int64)
    for i, rows in enumerate((text[:256], text[256:])):
        write_npz(str(folder / f"tokens-{i}.npz"), rows[:, :-1].copy(), rows[:, 1:].copy())
    return f"file://{folder}"


@pytest.fixture(scope="session")
def reference_cluster() -> Iterator[LocalElasticCluster]:
    # Shared memory off (`memfd.ENV`): the references' bodies and parameters go through the sockets, so
    # every test that compares a run with its reference also checks the shared-memory paths (inboxes,
    # parameters read in place) against plain copies, bit for bit.
    with LocalElasticCluster(static_workers=1, elastic_workers=1, env={memfd.ENV: "0"}) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalElasticCluster]:
    """The cluster fault tests share; each test tops it up to the elastic workers it needs."""
    with LocalElasticCluster(static_workers=2, elastic_workers=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def static_cluster() -> Iterator[LocalElasticCluster]:
    """The cluster of a module's static-role tests: 3 static workers (the job's roles, the coordinator beside
    data server 0, and a standby) and 2 elastic ones; the tests kill static workers and top them up
    (`tests.test_static_roles.top_up_static`)."""
    with LocalElasticCluster(static_workers=3, elastic_workers=2) as cluster:
        yield cluster


def make_job(digits_url: str, policy: str = "rollback", **overrides: object) -> ElasticJob:
    """The tests' job: a paced MLP on the digits, 2 epochs of steps of 4 micro-batches of 16, Adam,
    survival detection every 0.5 s, and `policy` on a membership change; `overrides` replace any field."""
    fields: dict[str, object] = {
        "model": "tests.models:slow_mlp",
        "dataset": digits_url,
        "batch_size": 16,
        "micro_batches": 4,
        "epochs": 2,
        "optimizer": {"name": "adam", "lr": 0.01},
        "liveness_interval": 0.5,
        "on_membership_change": policy,
        "job_id": f"test-{policy}",
        "min_workers_timeout": 60.0,
        # Every data server holds parameters, as a big model's would: a worker's push then goes to two
        # shards, the case the fault tests are about (the default puts a small model on one).
        "min_shard_bytes": 0,
    }
    fields.update(overrides)
    if os.environ.get("ELASTIC_TESTS_OVERLAP_PUSH") == "1" and fields.get("mode", "sync") == "sync":
        # Every sync test job sends its gradients during backward (the tests' mlp is under the size at which
        # the engine does so by itself): the tests of today run again over the overlapped step.
        fields.setdefault("overlap_push", True)
    if os.environ.get("ELASTIC_TESTS_OVERLAP_PULL") == "1" and fields.get("mode", "sync") == "sync":
        # ... and their parameters come back bucket by bucket during forward, from every shard.
        fields.setdefault("overlap_pull", fields.get("overlap_push") is not False)
    return ElasticJob(**fields)  # type: ignore[arg-type]


class References:
    """One-worker, no-fault results, computed once per job (job id and policy do not change the math)."""

    def __init__(self, cluster: LocalElasticCluster) -> None:
        self.cluster = cluster
        self._cache: dict[str, TrainResult] = {}

    def __call__(self, job: ElasticJob) -> TrainResult:
        # No checkpoint folder: a reference run must neither resume from nor write the tested run's files.
        # Gradients pushed whole after backward, parameters pulled whole: a run that sends them during
        # backward, or reads them during forward, is held to the bits of the plain path.
        whole = {"overlap_push": False, "overlap_pull": False}
        solo = job.model_copy(update={"job_id": "reference", "checkpoint": None, **whole})
        key = solo.model_copy(update={"on_membership_change": "rollback"}).model_dump_json()
        if key not in self._cache:
            assert len(self.cluster.elastic_addresses()) == 1
            self._cache[key] = train(solo, cluster=self.cluster)
        return self._cache[key]


@pytest.fixture(scope="session")
def reference(reference_cluster: LocalElasticCluster) -> References:
    return References(reference_cluster)


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 90.0, poll: float = 0.3) -> Any:
    """`probe()` once it is truthy, polled every `poll` seconds; fails after `timeout` seconds naming what."""
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def top_up(cluster: LocalElasticCluster, elastic: int) -> None:
    """Start elastic workers until `elastic` are alive (earlier tests may have killed some)."""
    # Workers a previous test added without waiting would otherwise join in the middle of this one.
    cluster.wait_for_pending()
    missing = elastic - len(cluster.elastic_addresses())
    names = [cluster.add_worker(wait=False) for _ in range(max(0, missing))]
    cluster.wait_for_workers(names)


def in_process_servers(digits_url: str, **overrides: Any) -> tuple[list[DataServer], list[list[str]]]:
    """The data servers of a test job (the mlp, `overrides` applied), made in this process (no cluster),
    and the plan of which tensors each holds."""
    prepared = prepare(make_job(digits_url, "reassign", **{"model": "tests.models:mlp", **overrides}))
    job, initial = prepared.job, prepared.persistence.initial
    plan = plan_shards(initial, job.data_servers, job.min_shard_bytes)
    made = []
    for i, names in enumerate(plan):
        start = prepared.persistence.shard_start(i, names)
        made.append(
            DataServer(
                i,
                prepared.specs.shard,
                prepared.batches,
                prepared.schedule,
                start.params,
                start.buffers,
                None,
                0,
                mode=prepared.mode.applies,
            )
        )
    return made, plan


class HoldUntilJoined:
    """An `on_progress` callback for jobs of `tests.models:gated_slow_mlp`: while a worker that `faults` added
    (or a nanny restarted) is not a member yet, training waits at the gate (in the model's forward
    pass), so that every join lands mid-run however slowly its process starts."""

    def __init__(self, faults: FaultSchedule) -> None:
        self.faults = faults
        self.initial: set[str] = set()
        self.seen: set[str] = set()

    def __call__(self, progress: Progress) -> None:
        from .models import GATE

        if not self.initial:
            self.initial.update(progress.workers)
        self.seen.update(progress.workers)
        expected = sum(1 for r in self.faults.log if r.kind in ("add", "restart"))
        if len(self.seen - self.initial) < expected and progress.state == "running":
            GATE.touch()
        else:
            GATE.unlink(missing_ok=True)


def assert_same_parameters(result: TrainResult, expected: TrainResult) -> None:
    assert_same_state(result.state_dict, expected.state_dict)


def assert_same_state(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bitwise equal to the one-worker, no-fault run's state_dict (same names, `torch.equal` tensors)."""
    assert list(state) == list(expected)
    differing = [k for k in expected if not torch.equal(state[k], expected[k])]
    assert not differing, f"tensors differ from the one-worker, no-fault run: {differing}"


def assert_ledger_exactly_once(result: TrainResult) -> None:
    job = result.job
    total_steps = result.total_steps
    assert result.counters["committed_steps"] == total_steps
    ids = [e.batch_id for e in result.ledger]
    assert ids == list(range(result.total_batches)), "every batch id of the schedule, each once"
    assert len(ids) == len(set(ids))
    assert all(e.worker for e in result.ledger), "each entry names the worker whose gradient was applied"
    # The ledger agrees with the parameter version: committed steps are exactly 0..version-1.
    assert {e.step for e in result.ledger} == set(range(total_steps))
    assert all(e.step == e.batch_id // job.micro_batches for e in result.ledger)
    assert len(result.history) == total_steps


@pytest.fixture
def tmp_dataset_dir(tmp_path: Path) -> Path:
    return tmp_path


# Cases of one test that differ only in a policy, a role or a mode: a run takes one of each test's, picked by
# the seed (`rotated_case`), so that successive CI runs go round them all while each run keeps every test.
# `ELASTIC_ALL_CASES=1` runs them all.
# (The mode and policy together first: "sync-rollback" holds "rollback".)
ROTATED_AXES: tuple[tuple[str, ...], ...] = (
    ("sync-rollback", "sync-reassign", "async-reassign"),
    ("rollback", "reassign"),
    ("data-server", "coordinator"),
    ("gpu-check", "user-model", "overlap-push", "overlap-pull"),
    ("no-nanny", "nanny"),  # ("-no-nanny-" holds "-nanny-": the longer first)
    ("sqlite", "postgres"),
    ("data_servers", "compute_workers"),  # (where a job's batches are made)
)


def rotated_value(case: str) -> tuple[int, str] | None:
    """The axis of `ROTATED_AXES` and its value that the case id `case` ("-" around it) holds, if any."""
    for a, axis in enumerate(ROTATED_AXES):
        for value in axis:
            if f"-{value}-" in case:
                return a, value
    return None


def rotated_case(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """`items` split into the ones this run keeps and the ones it leaves to other runs: of the cases of one
    test that differ only along one of `ROTATED_AXES`, the seed keeps one (a test's own salt turns them
    differently, so one run does not take the same policy everywhere)."""
    groups: dict[tuple[str, int], list[tuple[str, pytest.Item]]] = {}
    kept: list[pytest.Item] = []
    for item in items:
        spec = getattr(item, "callspec", None)
        # (Not the unit tests: they take milliseconds.)
        case = f"-{spec.id}-" if spec is not None and not item.nodeid.startswith("tests/unit/") else ""
        found = rotated_value(case)
        if found is None:
            kept.append(item)
            continue
        a, value = found
        rest = case.replace(f"-{value}-", "-", 1)
        groups.setdefault((item.nodeid.split("[")[0] + rest, a), []).append((value, item))
    left: list[pytest.Item] = []
    for (name, a), cases in groups.items():
        present = [v for v in ROTATED_AXES[a] if any(v == c for c, _ in cases)]
        chosen = rotated(present, salt=zlib.crc32(name.encode()))
        kept += [i for v, i in cases if v == chosen]
        left += [i for v, i in cases if v != chosen]
    return kept, left


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep one case of each rotated test (`rotated_case`), then run the tests that need the Prefect
    server last: the server's background services take most of a core while it is up, and the engine's
    cluster tests are better off without that company."""
    if os.environ.get("ELASTIC_ALL_CASES") != "1":
        kept, left = rotated_case(items)
        if left:
            config.hook.pytest_deselected(items=left)
            order = {id(i): n for n, i in enumerate(items)}
            items[:] = sorted(kept, key=lambda i: order[id(i)])
    items.sort(key=lambda item: "prefect_server" in getattr(item, "fixturenames", ()))
