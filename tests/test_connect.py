"""Connecting to clusters: static workers are never candidates for adaptive scale-down."""

from __future__ import annotations

import ast
import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import prefect_elastic
from prefect_elastic import train
from prefect_elastic.cluster import (
    WORKER_EVENTS_TOPIC,
    AnnounceRunning,
    KeepStaticWorkers,
    answering,
    connect,
    is_static_worker,
    local_cluster_class,
    resolve_cluster_class,
)
from prefect_elastic.errors import JobConfigError
from prefect_elastic.local.cluster import LocalElasticCluster

from .conftest import make_job, top_up, wait_for
from .prefect_harness import PrefectServer


def _scale_down_candidates(dask_scheduler: Any) -> list[str]:
    # The scheduler's own choice when asked to shrink to nothing, after every plugin had its say.
    return list(dask_scheduler.workers_to_close(target=0))


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_static_workers_are_never_scaled_down(cluster: LocalElasticCluster) -> None:
    top_up(cluster, 2)
    with cluster.client() as client:
        before = set(client.run_on_scheduler(_scale_down_candidates))
        assert set(cluster.static_addresses()) <= before, "without the plugin, static workers are candidates"
        with connect(cluster.scheduler_address) as where:
            assert where.address == cluster.scheduler_address and not where.made_here
        after = set(client.run_on_scheduler(_scale_down_candidates))
        assert after, "elastic workers can still be retired"
        assert not after & set(cluster.static_addresses())
        assert after <= set(cluster.elastic_addresses())
        client.unregister_scheduler_plugin(KeepStaticWorkers.name)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_worker_that_turns_running_is_announced_once(cluster: LocalElasticCluster) -> None:
    """A worker registers with the scheduler while "init": the add-worker event comes before it can take
    work. `AnnounceRunning` tells the job's controller (which admits a join on it) when it turns
    "running", once; its retirement (running to closing) is not announced."""
    top_up(cluster, 2)
    heard: list[str] = []
    with cluster.client(set_as_default=False) as client:
        client.register_plugin(AnnounceRunning(), name=AnnounceRunning.name)
        client.subscribe_topic(WORKER_EVENTS_TOPIC, lambda event: heard.append(event[1]["worker"]))
        name = cluster.add_worker()
        address = str(cluster.address_of(name))
        wait_for("the new worker's worker-running event", lambda: address in heard, timeout=30)
        cluster.retire_worker(name)
        client.unsubscribe_topic(WORKER_EVENTS_TOPIC)
    assert heard == [address], "one event, for the worker that joined, and none when it left"


# Evaluated where it runs: a function of this module would import the module there, and torch with it.
TORCH_IMPORTED = "'torch' in __import__('sys').modules"


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_worker_answers_until_it_is_frozen_or_killed(cluster: LocalElasticCluster) -> None:
    """What survival detection asks to tell a worker killed with the lost ones from one still there
    (`training.membership.wait_for_losses`): a live worker answers a connection; a frozen one does not,
    nor does a killed one, although the scheduler still lists it for tens of milliseconds. An address
    that is not one is never counted."""
    top_up(cluster, 1)
    name = cluster.add_worker()
    address = str(cluster.address_of(name))
    [other, *_] = [a for a in cluster.elastic_addresses() if a != address]  # (top_up: one at least)

    def ask(*addresses: str, timeout: float = 5.0) -> frozenset[str]:
        return asyncio.run(answering(addresses, timeout))

    assert ask(address, "inproc://127.0.0.1/1/1", "not an address") == {address}
    cluster.kill_worker(name, sig=signal.SIGSTOP)
    try:
        assert ask(address, timeout=1.0) == frozenset(), "a frozen worker does not answer"
    finally:
        cluster.kill_worker(name, sig=signal.SIGCONT)
    assert ask(address) == {address}
    cluster.kill_worker(name)
    assert ask(address, timeout=1.0) == frozenset(), "a killed worker answers nothing"
    assert ask(other, address, timeout=1.0) == {other}, "the others still answer"


def test_the_cluster_side_modules_import_no_torch() -> None:
    """The scheduler and the nannies unpickle the plugins and scheduler-side functions of
    `prefect_elastic.cluster` and `registry.py`, which import the package: were torch imported with it,
    each of those processes would spend 2 s of CPU and about 300 MB on it (a cluster of 4 workers started
    its first job 4 s later)."""
    probe = "import sys, prefect_elastic.cluster, prefect_elastic.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


PACKAGE = Path(prefect_elastic.__file__).parent
HARNESS = "prefect_elastic.local"


def engine_files() -> dict[str, Path]:
    """Every module of the package but the harness (`local/`) and the command line (the people's entry
    point, which starts the harness's demo), by name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "local" or relative == Path("cli.py"):
            continue
        parts = ["prefect_elastic", *relative.with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(path: Path, module: str) -> set[str]:
    """The modules a file's import statements name, relative ones made absolute; every statement, also
    those inside functions and under `TYPE_CHECKING`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            stem = ".".join([*base, *([node.module] if node.module else [])])
            names.add(stem)
            names.update(f"{stem}.{alias.name}" for alias in node.names)
    return names


def test_the_engine_and_its_imports_are_read_as_python_does() -> None:
    engine = engine_files()
    assert {"prefect_elastic", "prefect_elastic.cluster", "prefect_elastic.cluster.connection"} <= set(engine)
    assert not [m for m in engine if m.startswith(HARNESS)]
    local_cluster = imported_names(PACKAGE / "local" / "cluster.py", "prefect_elastic.local.cluster")
    assert "prefect_elastic.cluster.static" in local_cluster, "`..` is resolved against the package above"
    assert "prefect_elastic.local.processes" in local_cluster, "`.` against the module's own package"


def test_no_engine_module_imports_the_harness() -> None:
    """The engine runs on any Dask cluster; the local harness (`prefect_elastic.local`) is support for
    tests, demos and users' rehearsals. Read from the source, so an import in a function counts too."""
    offending = {
        module: sorted(n for n in imported_names(path, module) if n == HARNESS or n.startswith(HARNESS + "."))
        for module, path in engine_files().items()
    }
    assert not {module: names for module, names in offending.items() if names}


def test_with_no_cluster_given_the_harness_is_started_by_its_import_path() -> None:
    assert local_cluster_class() is LocalElasticCluster


def test_importing_the_engine_loads_nothing_of_the_harness() -> None:
    """In a fresh process: every engine module imported (the controller, the flow, the cluster side), and
    not one module of the harness loaded with them."""
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m == {HARNESS!r} or m.startswith({HARNESS + '.'!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *engine_files()], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_nannies_hold_no_torch_after_a_job(digits_url: str) -> None:
    # Plainly started processes: a fork server's nannies hold torch from the fork already.
    with LocalElasticCluster(1, 1, fork_server=False) as cluster:
        train(make_job(digits_url, job_id="nanny-imports", epochs=1), cluster=cluster)
        with cluster.client() as client:
            on_workers = client.run(eval, TORCH_IMPORTED)
            on_nannies = client.run(eval, TORCH_IMPORTED, nanny=True)
    assert on_workers and all(on_workers.values()), "the workers train, so they hold torch"
    assert on_nannies and not any(on_nannies.values()), on_nannies


def test_bad_cluster_class_is_named() -> None:
    with pytest.raises(JobConfigError, match=r"no_such_module\.Cluster"):
        resolve_cluster_class("no_such_module.Cluster")


# In a fresh process (dask_jobqueue not imported yet): the caller's own SIGINT handler, then
# `resolve_cluster_class("dask_jobqueue.SLURMCluster")` from a thread or from the main thread.
SLURM_CLASS_PROBE = """
import signal, sys, threading
from prefect_elastic.cluster import resolve_cluster_class
def callers(*_): pass
signal.signal(signal.SIGINT, callers)
found = []
def resolve(): found.append(resolve_cluster_class("dask_jobqueue.SLURMCluster"))
if sys.argv[1] == "thread":
    thread = threading.Thread(target=resolve)
    thread.start()
    thread.join()
else:
    resolve()
print(found[0].__name__, "dask_jobqueue.runner" in sys.modules, signal.getsignal(signal.SIGINT) is callers)
"""


@pytest.mark.parametrize("where", ["thread", "main"])
def test_the_slurm_cluster_class_imports_from_any_thread_and_leaves_sigint_as_it_was(where: str) -> None:
    """`dask_jobqueue.runner`, imported with `SLURMCluster`, installs a SIGINT handler as it is imported:
    from a thread that failed ("signal only works in main thread"), and on the main thread it replaced the
    caller's handler with `sys.exit`. Neither happens now."""
    out = subprocess.run([sys.executable, "-c", SLURM_CLASS_PROBE, where], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["SLURMCluster", "True", "True"], "imported, runner too, SIGINT untouched"
    with (
        pytest.raises(JobConfigError, match="address"),
        connect("tcp://127.0.0.1:9", cluster_class="distributed.LocalCluster"),
    ):
        pass


SPEC = {
    "scheduler": {
        "cls": "distributed.Scheduler",
        "options": {"dashboard_address": ":0", "host": "127.0.0.1"},
    },
    "workers": {
        "static-a": {"cls": "distributed.Nanny", "options": {"nthreads": 1, "resources": {"static": 1}}},
        "elastic-a": {"cls": "distributed.Nanny", "options": {"nthreads": 1}},
    },
}


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_cluster_class_with_kwargs_trains(digits_url: str) -> None:
    """The prefect-dask way: a cluster class by import path and its keyword arguments (JSON-able, as a
    Prefect parameter would be); the cluster is closed when the connection ends."""
    from prefect_elastic import train

    job = make_job(digits_url, model="tests.models:mlp", batch_size=32, epochs=1, job_id="spec")
    with connect(cluster_class="distributed.SpecCluster", cluster_kwargs=SPEC) as where:
        assert where.made_here
        result = train(job, address=where.address)
        cluster = where.cluster
    assert result.steps == result.total_steps
    assert cluster.status.name == "closed"


def test_cli_reports_a_bad_job_file_before_starting_anything(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("model: tests.models:mlp\ndataset: /nowhere\nbatch_size: 0\n")
    done = subprocess.run(
        [sys.executable, "-m", "prefect_elastic.cli", "train", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "batch_size=0" in done.stderr


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_cli_trains_a_job_file_through_the_flow(
    prefect_server: PrefectServer, cluster: LocalElasticCluster, digits_url: str, tmp_path: Path
) -> None:
    top_up(cluster, 1)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        make_job(digits_url, model="tests.models:mlp", batch_size=32, epochs=1, job_id="cli").to_yaml()
    )
    env = {**prefect_server.subprocess_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "prefect_elastic.cli", "train", str(spec),
         "--address", cluster.scheduler_address, "--output", str(tmp_path / "model.pt")],
        capture_output=True, text=True, timeout=200, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "COMPLETED" in done.stdout and f"{prefect_server.ui_url}/runs/flow-run/" in done.stdout
    assert (tmp_path / "model.pt").exists()


def test_is_static_worker_reads_the_resource_amount() -> None:
    assert is_static_worker({"resources": {"static": 1}})
    assert is_static_worker({"resources": {"data": 2.0}}, resource="data")
    assert not is_static_worker({"resources": {"static": 1}}, resource="data")
    assert not is_static_worker({"resources": {"static": 0}}), "static=0 runs no task that needs it"
    assert not is_static_worker({"resources": {}})
    assert not is_static_worker({"resources": None})
    assert not is_static_worker({"name": "elastic-0"})


def test_keep_static_workers_offers_only_elastic_workers_for_scale_down() -> None:
    class WorkerState:
        def __init__(self, resources: dict[str, float]) -> None:
            self.resources = resources

    static, elastic, zero = WorkerState({"static": 1}), WorkerState({}), WorkerState({"static": 0})
    plugin = KeepStaticWorkers()
    assert plugin.valid_workers_downscaling(None, [static, elastic, zero]) == [elastic, zero]


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_static_workers_must_be_a_whole_number(bad: object) -> None:
    with pytest.raises(JobConfigError, match=r"static_workers=.*whole number"), connect(static_workers=bad):  # type: ignore[arg-type]
        pass


def test_static_workers_need_a_cluster_class() -> None:
    with (
        pytest.raises(JobConfigError, match=r"static_workers=2: a running scheduler"),
        connect("tcp://127.0.0.1:9", static_workers=2),
    ):
        pass
    with (
        pytest.raises(JobConfigError, match=r"static_workers=1: a cluster object"),
        connect(cluster=object(), static_workers=1),
    ):
        pass


def test_static_worker_template_carries_the_resource_and_no_lifetime() -> None:
    from prefect_elastic.cluster import StaticWorkers

    class JobQueueLike:
        job_cls = type("SLURMJob", (), {"default_config_name": staticmethod(lambda: "slurm")})
        worker_spec: dict[str, Any] = {}
        new_spec = {
            "cls": object,
            "options": {
                "worker_extra_args": ["--lifetime", "55m", "--lifetime-stagger=4m", "--resources", "GPU=1"]
            },
        }

    static = StaticWorkers(JobQueueLike(), "static")
    assert static.template["options"]["worker_extra_args"] == ["--resources", "GPU=1 static=1"]
    assert static.template["options"]["job_name"] == "dask-worker-static"
    with pytest.raises(JobConfigError, match=r"static_workers=.*SpecCluster"):
        StaticWorkers(object())


def test_slurm_walltimes_read_in_every_format_slurm_takes() -> None:
    from prefect_elastic.cluster import walltime_seconds

    assert walltime_seconds("30") == 1800
    assert walltime_seconds("30:15") == 1815
    assert walltime_seconds("04:00:00") == 4 * 3600
    assert walltime_seconds("1-12") == 36 * 3600
    assert walltime_seconds("1-00:30") == 24 * 3600 + 1800
    assert walltime_seconds("2-01:02:03") == 2 * 86400 + 3723
    assert walltime_seconds("soon") is None and walltime_seconds("1:2:3:4") is None


def test_elastic_workers_get_a_lifetime_that_ends_before_the_walltime() -> None:
    from prefect_elastic.cluster import with_lifetime_before_walltime

    given = {"walltime": "04:00:00", "cores": 1, "worker_extra_args": ["--resources", "GPU=1"]}
    got = with_lifetime_before_walltime(given)
    args = got["worker_extra_args"]
    assert args[:2] == ["--resources", "GPU=1"] and given["worker_extra_args"] == ["--resources", "GPU=1"]
    lifetime = int(args[args.index("--lifetime") + 1].rstrip("s"))
    stagger = int(args[args.index("--lifetime-stagger") + 1].rstrip("s"))
    assert lifetime + stagger < 4 * 3600, "even the latest staggered end comes before the walltime"
    assert lifetime + stagger == 4 * 3600 - 300, "5 minutes of margin for a 4-hour job"
    # A lifetime the user gave is kept; no walltime, or one too short to leave a margin: nothing added.
    own = {"walltime": "04:00:00", "worker_extra_args": ["--lifetime", "1h"]}
    assert with_lifetime_before_walltime(own) == own
    assert with_lifetime_before_walltime({"cores": 1}) == {"cores": 1}
    assert with_lifetime_before_walltime({"walltime": "00:01:00"}) == {"walltime": "00:01:00"}
