"""Training on a real SLURM cluster through dask-jobqueue: `slurmctld` and two `slurmd` nodes on 127.0.0.1
(`LocalSlurm`, started once for this module), `SLURMCluster` jobs that run `dask worker`.

- a flow run with `static_workers=2` and `adapt`, an elastic worker's job `scancel`led mid-run (SIGTERM,
  SIGKILL after KillWait): its job is replaced, and the result is bitwise equal to the one-worker no-fault
  run, every batch id once;
- an elastic worker whose `--lifetime` ends mid-run leaves gracefully and is replaced by a new job (Dask's
  adaptive scaling alone would not submit one): nothing committed is redone, bitwise equal;
- the examples in examples/slurm: the `sbatch` script through `sbatch`, the Python script directly.

Training is held at the gate of `tests.models` while the fault and the replacement happen, so each lands
mid-run whatever the machine's speed; every wait is bounded. The packages come from
scripts/install-slurm.sh and the `slurm` extra (dask-jobqueue).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import Client

from prefect_elastic import TrainResult, train
from prefect_elastic.cluster import connect
from prefect_elastic.local.prefect_server import free_port
from prefect_elastic.local.slurm import LocalSlurm
from prefect_elastic.messages import Progress
from prefect_elastic.registry import read_progress

from .conftest import (
    References,
    assert_ledger_exactly_once,
    assert_same_state,
    held_training,
    make_job,
    wait_for,
)
from .models import GATE, HOLD
from .prefect_harness import PrefectServer

# (A SLURM controller and two nodes, then real jobs: .ci/run runs these after the main suite.)
pytestmark = [pytest.mark.cluster, pytest.mark.heavy, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "slurm"


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    with LocalSlurm(kill_wait=5) as cluster, cluster.activate():
        yield cluster


def slurm_kwargs(tmp_path: Path, port: int = 0, worker_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """SLURMCluster's arguments for the test cluster: jobs of 1 core on the `debug` partition that run our
    interpreter with this checkout importable (the test's models), everything on 127.0.0.1."""
    return {
        "cores": 1,
        "memory": "2GB",
        "processes": 1,
        "walltime": "00:15:00",
        "queue": "debug",
        "python": sys.executable,
        "log_directory": str(tmp_path / "slurm-logs"),
        "scheduler_options": {"host": "127.0.0.1", "port": port, "dashboard_address": ":0"},
        "job_script_prologue": [f"export PYTHONPATH={ROOT}", f"cd {ROOT}"],
        "worker_extra_args": ["--host", "127.0.0.1", *worker_args],
    }


def jobs_named(slurm: LocalSlurm) -> dict[str, str]:
    """Running or pending SLURM jobs: job id -> job name (static jobs are named `...-static`)."""
    out = slurm.command("squeue", "-h", "-o", "%i %j")
    return dict(line.split() for line in out.splitlines() if line.strip())


def elastic_jobs(slurm: LocalSlurm) -> set[str]:
    return {job for job, name in jobs_named(slurm).items() if not name.endswith("-static")}


def static_jobs(slurm: LocalSlurm) -> set[str]:
    return {job for job, name in jobs_named(slurm).items() if name.endswith("-static")}


# The flow is called from a thread (as an application's own scheduler or a notebook's kernel may call
# it): `dask_jobqueue.SLURMCluster` imports there, and the process's SIGINT handler stays as it was.
RUN_FLOW = textwrap.dedent(
    """
    import json, signal, sys, threading
    from prefect_elastic.flows import elastic_training
    job, kwargs, output = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    sigint = signal.getsignal(signal.SIGINT)
    states = []
    def run():
        states.append(elastic_training(
            job, cluster_class="dask_jobqueue.SLURMCluster", cluster_kwargs=kwargs, static_workers=2,
            adapt_kwargs={"minimum": 2, "maximum": 2}, output=output, return_state=True,
        ))
    thread = threading.Thread(target=run, name="caller")
    thread.start()
    thread.join()
    [state] = states
    print("SIGINT", "kept" if signal.getsignal(signal.SIGINT) is sigint else "replaced", flush=True)
    print("STATE", state.type.value, flush=True)
    print("RESULT", json.dumps(state.result()), flush=True)
    """
)


def test_flow_run_on_slurm_with_an_elastic_job_scancelled(
    slurm: LocalSlurm, prefect_server: PrefectServer, reference: References, digits_url: str, tmp_path: Path
) -> None:
    """The issue's call: `elastic_training(job, cluster_class="dask_jobqueue.SLURMCluster", ...,
    static_workers=2, adapt_kwargs=...)` in its own process, as under a deployment, from a thread of it
    (the cluster class imports there, and the process's SIGINT handler is left as it was). Two static
    jobs carry the static resource and two elastic ones scale with adapt; training is held at a step of
    at least 2 while one elastic job is `scancel`led (pre-emption: SIGTERM, then SIGKILL after KillWait)
    and until the job submitted in its place is a member. The result is the one-worker no-fault run's,
    bit for bit, and every batch id is committed once."""
    job = make_job(digits_url, model="tests.models:held_mlp", epochs=1, job_id="slurm-flow")
    spec = tmp_path / "job.yaml"
    spec.write_text(job.to_yaml())
    script = tmp_path / "run_flow.py"
    script.write_text(RUN_FLOW)
    port = free_port()
    kwargs = slurm_kwargs(tmp_path, port)
    output = tmp_path / "model.pt"
    env = {**prefect_server.subprocess_env(), **slurm.env, "PYTHONPATH": str(ROOT)}
    # The Prefect variables of the server, and the tests' signal files (the jobs inherit them from sbatch).
    env.update({k: v for k, v in os.environ.items() if k.startswith("ELASTIC_TESTS_")})
    with held_training():
        proc = subprocess.Popen(
            [sys.executable, str(script), str(spec), json.dumps(kwargs), str(output)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
        )  # fmt: skip
        try:
            wait_for("2 static and 2 elastic SLURM jobs", lambda: len(static_jobs(slurm)) == 2, 60)
            wait_for("training held at a step of at least 2", GATE.exists, 180)
            with Client(f"tcp://127.0.0.1:{port}", timeout=30) as client:

                def members() -> Progress | None:
                    p = read_progress(client, job.job_id)
                    return p if p is not None and len(p.workers) == 2 else None

                # The elastic jobs may start one after the other: the second joins while training stands.
                # (Under rollback the join itself may send training back to the last snapshot, step 0.)
                first = wait_for("both elastic workers to be members", members, 120)
                assert first.state == "running"
                victim = sorted(elastic_jobs(slurm))[0]
                slurm.command("scancel", victim)

                def replacement_is_a_member() -> bool:
                    p = read_progress(client, job.job_id)
                    return p is not None and len(p.workers) == 2 and set(p.workers) != set(first.workers)

                wait_for("the job in place of the cancelled one to be a member", replacement_is_a_member, 120)
                assert victim not in elastic_jobs(slurm)
                assert len(elastic_jobs(slurm)) == 2 and len(static_jobs(slurm)) == 2
            HOLD.unlink(missing_ok=True)
            GATE.unlink(missing_ok=True)
            out, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    assert proc.returncode == 0 and "STATE COMPLETED" in out, out[-4000:]
    assert "SIGINT kept" in out, "importing dask_jobqueue left the caller's Ctrl-C handler as it was"
    summary = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert summary["exactly_once"] and summary["batches_committed"] == summary["total_steps"] * 4
    events = summary["events"]
    changes = [(e["kind"], e["step"], e["left"], e["joined"]) for e in events if e["kind"] != "snapshot"]
    lost = {w for e in summary["events"] for w in e["left"]}
    joined = {w for e in summary["events"][1:] for w in e["joined"]}
    # The cancelled job's worker left, and the worker of the job submitted in its place joined and trained.
    # (On a loaded machine a member may also miss heartbeats for a moment: it leaves and joins again.)
    assert lost & set(first.workers), changes
    assert joined - set(first.workers), changes
    expected = reference(job)
    assert_same_state(torch.load(output), expected.state_dict)


def test_elastic_worker_whose_lifetime_ends_mid_run_is_replaced(
    slurm: LocalSlurm, reference: References, digits_url: str, tmp_path: Path
) -> None:
    """Elastic workers get a lifetime shorter than the walltime (dask-jobqueue's `--lifetime`): the one
    elastic worker of an adaptive cluster (minimum 1, maximum 1) reaches it while training is held at a
    step of at least 2, leaves gracefully (Dask retires it), and `connect`'s resubmission gives it a new
    job, which Dask's adaptive scaling would not (the ended job still counts in its plan). A graceful leave
    is not rolled back, even under the rollback policy: nothing committed is redone; the result is
    bitwise equal, every batch id once."""
    # (Paced: unpaced steps could all commit before the controller saw step 2 and closed the gate.)
    job = make_job(
        digits_url, "rollback", model="tests.models:gated_slow_mlp", epochs=1, job_id="slurm-lifetime"
    )
    kwargs = slurm_kwargs(tmp_path, worker_args=("--lifetime", "20s", "--lifetime-stagger", "1s"))
    initial: set[str] = set()

    def hold_until_replaced(p: Progress) -> None:
        # From step 2, training waits in the forward pass until the first worker is gone and a new one is
        # a member: the lifetime ends mid-run, and the replacement trains, however fast the machine is.
        if not initial:
            initial.update(p.workers)
        replaced = bool(initial) and not initial & set(p.workers) and bool(p.workers)
        if p.committed_steps >= 2 and not replaced and p.state == "running":
            GATE.touch()
        else:
            GATE.unlink(missing_ok=True)

    try:
        with connect(
            cluster_class="dask_jobqueue.SLURMCluster",
            cluster_kwargs=kwargs,
            adapt_kwargs={"minimum": 1, "maximum": 1},
            static_workers=2,
        ) as where:
            result = train(job, cluster=where.cluster, on_progress=hold_until_replaced)
            assert where.resubmit is not None
            replaced = list(where.resubmit.replaced)
    finally:
        GATE.unlink(missing_ok=True)
    assert replaced and not any(old.startswith("static") for old, _ in replaced), replaced
    check_against_reference(result, reference(job))
    lost = {w for e in result.membership_events() for w in e.left}
    assert initial <= lost, "the worker whose lifetime ended left the membership"
    assert any(e.worker not in initial for e in result.ledger), "and its replacement's gradients were applied"
    # Its last leave, at its lifetime's end, was graceful: no rollback, no committed step redone. (A
    # member may also miss heartbeats earlier, leave and come back: that leave is a loss, rolled back.)
    leaves = [e for e in result.membership_events() if initial & set(e.left)]
    assert leaves and leaves[-1].kind == "reassign" and "gracefully" in leaves[-1].reason, [
        (e.kind, e.left, e.joined, e.reason) for e in result.membership_events()
    ]
    if "shards were at versions" not in leaves[-1].reason:  # (its process may end between two pushes)
        assert leaves[-1].steps_lost == 0, "a graceful leave redoes no committed step, even under rollback"


def check_against_reference(result: TrainResult, expected: TrainResult) -> None:
    assert_same_state(result.state_dict, expected.state_dict)
    assert_ledger_exactly_once(result)


def test_static_workers_are_slurm_jobs_with_the_static_resource(slurm: LocalSlurm, tmp_path: Path) -> None:
    """Static jobs carry `--resources static=1` and no lifetime, elastic ones the lifetime; adapt counts
    elastic workers only and never closes a static one, even when it would close every elastic one."""
    kwargs = slurm_kwargs(tmp_path, worker_args=("--lifetime", "10m"))
    with connect(
        cluster_class="dask_jobqueue.SLURMCluster",
        cluster_kwargs=kwargs,
        adapt_kwargs={"minimum": 0, "maximum": 2, "interval": "200ms", "wait_count": 1},
        static_workers=2,
    ) as where:
        cluster = where.cluster
        assert where.static is not None
        static_spec = cluster.worker_spec[sorted(where.static.names())[0]]["options"]
        assert static_spec["worker_extra_args"][-2:] == ["--resources", "static=1"]
        assert "--lifetime" not in static_spec["worker_extra_args"]
        assert "--lifetime" in cluster.new_spec["options"]["worker_extra_args"]
        with Client(where.address, timeout=30) as client:
            client.wait_for_workers(2, timeout=120)
            info = client.scheduler_info(n_workers=-1)["workers"].values()
            assert sorted(str(w["name"]) for w in info if w["resources"].get("static")) == sorted(
                where.static.names()
            )
            # Nothing to do: adaptive scaling keeps the minimum of elastic workers (none) and both static.
            wait_for("adapt to settle with no elastic worker", lambda: not elastic_jobs(slurm), 30)
            assert len(static_jobs(slurm)) == 2


# A bound on a hang, not on speed: each example takes about a minute here, over three under a loaded CI
# machine's load (one sbatch job took past 240 s while a soak ran beside it).
SBATCH_TIMEOUT = 420


@pytest.mark.timeout(2 * SBATCH_TIMEOUT + 60)
def test_slurm_examples_run_at_a_tiny_size(
    slurm: LocalSlurm, prefect_server: PrefectServer, digits_url: str, tmp_path: Path
) -> None:
    """examples/slurm: `sbatch train.sbatch JOB` (a scheduler, static and elastic workers and the flow in
    one allocation) finishes and writes the model; `python train_slurmcluster.py` (SLURMCluster, the
    Prefect way) does the same."""
    job = make_job(digits_url, model="tests.models:mlp", epochs=1, job_id="slurm-example")
    spec = tmp_path / "job.yaml"
    spec.write_text(job.to_yaml())
    env = {**prefect_server.subprocess_env(), **slurm.env, "PYTHONPATH": str(ROOT)}
    env["PYTHON"] = sys.executable
    out = tmp_path / "sbatch-model.pt"
    submitted = subprocess.run(
        [slurm.paths["sbatch"], "--parsable", "--output", str(tmp_path / "sbatch-%j.log"),
         str(EXAMPLES / "train.sbatch"), str(spec), str(out)],
        capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    log = tmp_path / f"sbatch-{job_id}.log"
    wait_for("the sbatch example's job to end", lambda: job_id not in slurm.jobs(), SBATCH_TIMEOUT, 1.0)
    text = log.read_text() if log.exists() else "<no log>"
    assert out.exists() and "COMPLETED" in text, text[-4000:]

    py_out = tmp_path / "python-model.pt"
    ran = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_slurmcluster.py"), str(spec), "--output", str(py_out),
         "--static-workers", "1", "--minimum", "1", "--maximum", "1", "--cores", "1", "--memory", "2GB",
         "--walltime", "00:15:00", "--queue", "debug", "--host", "127.0.0.1",
         "--log-directory", str(tmp_path / "slurm-logs")],
        capture_output=True, text=True, timeout=SBATCH_TIMEOUT, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert py_out.exists() and "COMPLETED" in ran.stdout, ran.stdout[-3000:]
    assert_same_state(torch.load(py_out), torch.load(out))
