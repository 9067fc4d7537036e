"""The examples in `examples/`, run as a user runs them, at a tiny size, against a real Prefect server and
real local Dask clusters: your own model and data with a job YAML; a Prefect automation that reacts to a
lost worker. (The SLURM and compose examples are run by tests/test_slurm.py and tests/test_compose.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from prefect_elastic.local.cluster import LocalElasticCluster

from .conftest import top_up, wait_for
from .models import GATE
from .prefect_harness import PrefectServer, rest_client
from .test_flow import FlowRun, flow_job, workers_in

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def test_own_model_and_data_from_a_job_yaml(prefect_server: PrefectServer, tmp_path: Path) -> None:
    """`make_data.py`, then `prefect-elastic train job.yaml` on the local cluster it starts, as the
    example's README says; the model written at the end fits the data better than an untrained one."""
    folder = EXAMPLES / "own_model"
    data = tmp_path / "sine"
    made = subprocess.run(
        [sys.executable, "make_data.py", "--out", str(data), "--samples", "512"],
        cwd=folder, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    spec = yaml.safe_load((folder / "job.yaml").read_text())
    spec.update(dataset=f"file://{data}", epochs=2)  # 512 samples, steps of 2 x 64: 8 steps
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(spec))
    output = tmp_path / "model.pt"
    env = {**prefect_server.subprocess_env(), "PYTHONPATH": f".:{ROOT}"}
    trained = subprocess.run(
        [str(Path(sys.executable).with_name("prefect-elastic")), "train", str(job_yaml), "--output",
         str(output)],
        cwd=folder, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "COMPLETED" in trained.stdout and "trained 8 steps" in trained.stdout, trained.stdout

    sys.path.insert(0, str(folder))
    try:
        from sine_model import sine_mlp  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(folder))
    shards = [np.load(p) for p in sorted(data.glob("*.npz"))]
    x = torch.from_numpy(np.concatenate([s["x"] for s in shards]))
    y = torch.from_numpy(np.concatenate([s["y"] for s in shards]))
    model = sine_mlp()
    model.load_state_dict(torch.load(output, weights_only=True))
    with torch.no_grad():
        fitted = torch.nn.functional.mse_loss(model(x), y).item()
    # Better than the best constant (the mean of y) by half: the model learned the sine's shape. (Not
    # against an untrained model: a random one can already be close to the constant.)
    constant = y.var(unbiased=False).item()
    assert fitted < constant / 2, (fitted, constant)


@pytest.mark.heavy  # (in .ci/run's second stage: the main suite stays under issue 9's 15 minutes)
def test_automation_runs_a_flow_for_a_lost_worker(
    prefect_server: PrefectServer, cluster: LocalElasticCluster, digits_url: str, tmp_path: Path
) -> None:
    """`on_worker_lost.py serve` and `create`, then a training flow run whose worker is SIGKILLed: the
    automation runs the notice flow, with the job and the killed worker as its parameters."""
    script = EXAMPLES / "automation" / "on_worker_lost.py"
    env = {**prefect_server.subprocess_env(), "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "serve.log").open("w")
    served = subprocess.Popen(
        [sys.executable, str(script), "serve"], stdout=log, stderr=subprocess.STDOUT, env=env, text=True
    )
    api = rest_client(prefect_server.api_url)
    automation_ids: list[str] = []
    try:
        name = "/deployments/name/worker-lost-notice/on-worker-lost"
        deployment = wait_for("the notice deployment", lambda: (r := api.get(name)).is_success and r.json())
        created = subprocess.run(
            [sys.executable, str(script), "create"], capture_output=True, text=True, env=env, timeout=60
        )
        assert created.returncode == 0, created.stdout + created.stderr
        automation_ids.append(created.stdout.split()[1].rstrip(":"))

        top_up(cluster, 2)
        job = flow_job(digits_url)
        GATE.touch()  # training waits at its first step until the kill below is recorded
        try:
            run = FlowRun(prefect_server, job, cluster.scheduler_address, tmp_path / "flow")
            joined = wait_for(
                "both workers to join",
                lambda: len(workers_in(run.events(), "prefect-elastic.worker.joined")) >= 2 and run.events(),
            )
            victim = sorted(workers_in(joined, "prefect-elastic.worker.joined"))[0]
            cluster.kill_worker(victim)
            wait_for(
                "the loss to reach Prefect",
                lambda: victim in workers_in(run.events(), "prefect-elastic.worker.lost"),
            )
        finally:
            GATE.unlink(missing_ok=True)
        assert "STATE COMPLETED" in run.finish()

        def notice_runs() -> list[dict[str, object]]:
            body = {"deployments": {"id": {"any_": [deployment["id"]]}}}
            runs = api.post("/flow_runs/filter", json=body).json()
            return [r for r in runs if r["state"]["type"] == "COMPLETED"]

        done = wait_for("the automation's flow run to complete", notice_runs, timeout=120)
        params = [r["parameters"] for r in done]
        assert {"job": job.job_id, "worker": victim} in [{k: p[k] for k in ("job", "worker")} for p in params]
    finally:
        for automation_id in automation_ids:
            api.delete(f"/automations/{automation_id}")  # no notice for the other tests' kills
        served.terminate()
        served.wait(timeout=30)
        log.close()
        api.close()
