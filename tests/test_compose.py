"""The compose stack for real: the image built locally, `docker-compose up`, a run of the deployment through
the Prefect API, an elastic container killed mid-run and another scaled up, and the completed run's
artifacts read back from the server.

Runs on a private Docker engine (tests/docker_harness.py) with docker-compose.test.yml: host networking,
every service on 127.0.0.1 on free ports. Needs root and Debian's docker.io, docker-compose and
debootstrap (scripts/install-docker.sh, which this module runs; it installs only what is missing). The
image build (scripts/build-image.sh) is cached, so only the first run pays for debootstrap and the wheels.
Marked `compose`: run with `pytest -m compose`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from prefect_elastic.local.prefect_server import free_port

from .cli_cluster import CPU_SHARE_PROBE, probed_share
from .docker_harness import ROOT, Compose, DockerEngine, cache_dir, missing_tools
from .prefect_harness import rest_client

# The whole module, the image build included: a cold build (debootstrap, wheels, venv) takes several minutes.
pytestmark = [pytest.mark.compose, pytest.mark.timeout(1800)]

FLOW, DEPLOYMENT = "elastic-training", "compose"
IMAGE = "prefect-elastic:local"  # (scripts/build-image.sh's tag, and docker-compose.yml's image)
JOB_KEY = "digits-compose"
# For this run only: two elastic workers at least, so that after the kill training waits for the container
# scaled up in its place and that container's worker is sure to join; a wait long enough for a cold start.
# Enough epochs that the kill lands mid-run on a fast machine: 12 (336 steps) took 1.7 s on 2026-11-25, and
# the job had ended before the killed container's worker was seen gone; 150 take about 20 s there.
OVERRIDES = {"epochs": 150, "min_workers": 2, "min_workers_timeout": 300.0}
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

# Bounds of the waits (not timing assertions).
BUILD_S = 1500
STACK_S = 300.0
START_TRAINING_S = 300.0
FINISH_S = 600.0

T = TypeVar("T")


@pytest.fixture(scope="module")
def engine() -> Iterator[DockerEngine]:
    if os.geteuid() != 0:
        pytest.skip("the compose test starts its own Docker engine, which needs root")
    subprocess.run(["bash", "scripts/install-docker.sh"], cwd=ROOT, check=True, timeout=600)
    assert not missing_tools(), f"missing after scripts/install-docker.sh: {missing_tools()}"
    with DockerEngine(cache_dir() / "docker") as docker:
        subprocess.run(
            ["bash", "scripts/build-image.sh"], cwd=ROOT, env=docker.env, check=True, timeout=BUILD_S
        )
        yield docker


def wait_for(what: str, probe: Callable[[], T | None], seconds: float, every: float = 1.0) -> T:
    deadline = time.monotonic() + seconds
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds:.0f} s")
        time.sleep(every)


def worker_address(compose: Compose, container: str) -> str | None:
    """The address a worker container's Dask worker registered with (from its log)."""
    found = re.search(r"Start worker at:\s+(tcp://\S+)", compose.container_log(container))
    return found.group(1) if found else None


def latest_artifacts(api: httpx.Client, flow_run_id: str) -> dict[str, Any]:
    """The newest version of each artifact of the flow run, by key, with table data parsed."""
    rows = api.post(
        "/artifacts/filter",
        json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "CREATED_DESC"},
    ).json()
    latest: dict[str, Any] = {}
    for artifact in rows:
        if artifact["key"] and artifact["key"] not in latest:
            data = artifact["data"]
            latest[artifact["key"]] = json.loads(data) if artifact["type"] == "table" else data
    return latest


def test_stack_trains_through_a_killed_elastic_container(engine: DockerEngine) -> None:
    ports = {
        "PE_PG_PORT": free_port(),
        "PE_API_PORT": free_port(),
        "PE_SCHEDULER_PORT": free_port(),
        "PE_DASHBOARD_PORT": free_port(),
    }
    compose = Compose(
        engine,
        f"pe-{uuid.uuid4().hex[:8]}",
        [ROOT / "docker-compose.yml", ROOT / "docker-compose.test.yml"],
        {k: str(v) for k, v in ports.items()},
    )
    with (
        compose.up("--scale", "elastic=2", timeout=STACK_S),
        rest_client(f"http://127.0.0.1:{ports['PE_API_PORT']}/api") as api,
    ):
        try:
            check_run(compose, api)
        except Exception as exc:
            # What the containers said is what explains a failure here.
            raise AssertionError(f"{exc}\n--- docker-compose logs ---\n{compose.logs()}") from exc


def test_a_container_started_with_cpus_reads_its_cgroups_quota(engine: DockerEngine) -> None:
    """`docker run --cpus 1.5`: every core of the machine in the container's CPU set, and 1.5 cores' worth
    of CPU time in its cgroup's quota. `cluster.cpu_share`, which the engine's default for the overlapped
    step runs in every worker, reads the quota from inside the container."""
    done = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--cpus", "1.5", IMAGE, "python", "-c",
         CPU_SHARE_PROBE],
        env=engine.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    share = probed_share(done.stdout)
    assert share.quota == 1.5 and share.cpus, share
    # The container's kernel is this machine's: the engine counts it as this machine, whatever its address.
    assert share.machine == Path("/proc/sys/kernel/random/boot_id").read_text().strip(), share


def check_run(compose: Compose, api: httpx.Client) -> None:
    # The stack's Prefect worker registers the deployment once the server is up.
    def deployment() -> dict[str, Any] | None:
        try:
            r = api.get(f"/deployments/name/{FLOW}/{DEPLOYMENT}")
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 else None

    dep = wait_for("the deployment registered by the stack's Prefect worker", deployment, STACK_S, every=2.0)
    created = api.post(
        f"/deployments/{dep['id']}/create_flow_run", json={"parameters": {"overrides": OVERRIDES}}
    )
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    def state() -> str:
        return str(api.get(f"/flow_runs/{run_id}").json()["state_type"])

    # Mid-run: some steps committed, not all.
    def training() -> float | None:
        if (s := state()) in TERMINAL:
            raise AssertionError(f"the flow run ended {s} before any worker was killed")
        progress = latest_artifacts(api, run_id).get(f"{JOB_KEY}-progress")
        return progress if progress is not None and 0 < float(progress) < 100 else None

    wait_for("training to commit its first steps", training, START_TRAINING_S, every=0.5)

    before = compose.containers("elastic")
    assert len(before) == 2, before
    victim = before[0]
    victim_address = worker_address(compose, victim)
    assert victim_address, f"no worker address in the log of {victim}"
    compose.docker("kill", victim)
    # Removed, so that scaling back to two makes a new container (compose would start the killed one again).
    compose.docker("rm", victim)
    compose.run("up", "-d", "--scale", "elastic=2", "--no-recreate", timeout=STACK_S)
    added = [c for c in compose.containers("elastic") if c not in before]
    assert len(added) == 1, f"scaling up gave {added}"
    new_address = wait_for(
        "the new elastic worker to start", lambda: worker_address(compose, added[0]), STACK_S, every=2.0
    )

    final = wait_for("the flow run to end", lambda: s if (s := state()) in TERMINAL else None, FINISH_S, 2.0)
    assert final == "COMPLETED", f"the flow run ended {final}"

    artifacts = latest_artifacts(api, run_id)
    [result] = artifacts[f"{JOB_KEY}-result"]
    assert result["exactly_once"] is True, result
    assert result["steps"] == result["total_steps"], result
    assert result["workers_lost"] >= 1, result
    membership = artifacts[f"{JOB_KEY}-membership"]
    lost = {a.strip() for row in membership for a in row["lost"].split(",") if a.strip()}
    joined = {a.strip() for row in membership for a in row["joined"].split(",") if a.strip()}
    assert victim_address in lost, (victim_address, membership)
    assert new_address in joined, (new_address, membership)
    assert "# Job `digits-compose`" in artifacts[f"{JOB_KEY}-summary"]
