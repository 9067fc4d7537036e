"""The Prefect UI in a real browser (Debian's headless Chromium): the flow run's page shows the progress
artifact of a training run. Its screenshots go to a temporary folder; `bash scripts/screenshots.sh` runs
this test with `--screenshots docs/img` to update the README's (nothing else writes there)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from prefect_elastic.local.cluster import LocalElasticCluster

from .conftest import top_up
from .prefect_harness import PrefectServer
from .test_flow import FlowRun, flow_job

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def chromium(url: str, tmp_path: Path, *args: str) -> str:
    browser = shutil.which("chromium")
    assert browser, "Debian's chromium is missing: run scripts/install-browser.sh (scripts/test.sh does)"
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    command = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=20000", "--window-size=1400,1000", *args, url,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def test_flow_run_page_shows_the_progress_artifact(
    prefect_server: PrefectServer,
    cluster: LocalElasticCluster,
    digits_url: str,
    tmp_path: Path,
    screenshots: Path,
) -> None:
    top_up(cluster, 1)
    job = flow_job(digits_url, model="tests.models:mlp", job_id="ui-demo")
    run = FlowRun(prefect_server, job, cluster.scheduler_address, tmp_path)
    assert "STATE COMPLETED" in run.finish()
    flow_run = run.api.get(f"/flow_runs/{run.id}").json()
    progress = next(a for k, a in run.artifacts().items() if k.endswith("-progress"))

    page = f"{prefect_server.ui_url}/runs/flow-run/{run.id}"
    # One browser run each page, for its DOM and its screenshot: the run graph on this page draws the
    # artifact (a canvas: the screenshot shows it, the DOM cannot).
    dom = chromium(page, tmp_path, "--dump-dom", f"--screenshot={screenshots / 'flow-run.png'}")
    assert flow_run["name"] in dom and "Completed" in dom and "Artifacts" in dom, (
        "the flow run's page rendered"
    )

    # The "latest" listing gives the artifact key's collection; its latest_id is the artifact itself.
    artifact = f"{prefect_server.ui_url}/artifacts/artifact/{progress['latest_id']}"
    dom = chromium(artifact, tmp_path, "--dump-dom", f"--screenshot={screenshots / 'progress-artifact.png'}")
    assert progress["key"] in dom and "Progress: 100%" in dom, "the progress artifact shows 100%"
    assert flow_run["name"] in dom, "and links the flow run it belongs to"
    assert (screenshots / "flow-run.png").stat().st_size > 10_000
