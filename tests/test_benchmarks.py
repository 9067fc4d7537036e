"""The benchmark suite's code, run end to end at tiny sizes (`--smoke`). Its timings are not checked here:
speed is measured by `bash scripts/bench.sh` and reported in docs/benchmarks.md, never asserted in tests."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from benchmarks.elastic import fixed_cost, snapshot_excess
from benchmarks.frozen import longest_gap
from benchmarks.report import END, START, figures
from benchmarks.run import GROUPS
from benchmarks.scaling import END as SCALING_END
from benchmarks.scaling import START as SCALING_START
from benchmarks.scaling_model import (
    config_figures,
    fit_fixed_cost,
    median_repeat,
    predict,
    samples_for,
    shard_load_mb,
)
from prefect_elastic.schedule import Schedule

from .conftest import rotated

ROOT = Path(__file__).resolve().parent.parent


def steps_of(gaps: list[float]) -> list[float]:
    return np.cumsum([0.0, *gaps]).tolist()


def test_snapshot_excess_finds_the_time_snapshots_add() -> None:
    # 600 steps of about 0.1 s (a deterministic wobble), a snapshot every second that makes the step
    # it lands in 10 ms longer: 1% of the run.
    rng = np.random.default_rng(0)
    gaps = (0.1 + rng.normal(0, 0.003, 600)).tolist()
    windows = []
    for k in range(1, 59):
        step = 10 * k + 3
        gaps[step] += 0.010
        start = sum(gaps[: step + 1]) - 0.02  # ends inside that step, 2 ms long
        windows.append((start - 0.002, start))
    found = snapshot_excess(steps_of(gaps), windows, skip=0)
    assert found["snapshots"] == 58
    assert 0.008 < found["overhead"] < 0.012, found
    # The same windows over the same run without the added time: the measure reads about zero.
    plain = (0.1 + rng.normal(0, 0.003, 600)).tolist()
    assert abs(snapshot_excess(steps_of(plain), windows, skip=0)["overhead"]) < 0.002


def test_snapshot_excess_needs_steps() -> None:
    with pytest.raises(ValueError, match="too few steps"):
        snapshot_excess([0.0, 0.1], [], skip=0)


def test_fixed_cost_is_step_time_minus_the_steady_compute() -> None:
    # 11 commits 25 ms apart after 5 slower ones; the loop's steady steps (from its 6th on) computed 20 ms
    # each, its first 5 took 45 ms (in `phases` only, as a fresh process's first steps are slower).
    times = steps_of([0.05] * 5 + [0.025] * 10)
    steady = {"compute": 11 * 0.020, "push": 11 * 0.002, "pull": 0.011}
    whole = {"compute": 5 * 0.045 + 11 * 0.020, "push": 16 * 0.002, "pull": 0.016}
    loop = SimpleNamespace(steps=16, steady_steps=11, phases=whole, steady_phases=steady)
    shards = [{"handle": 16 * 0.001, "apply": 16 * 0.0005, "frames": 32.0}]
    result = SimpleNamespace(commit_times=times, loops=[loop], steps=16, shard_phases=shards)
    cost = fixed_cost(result, skip=5)
    assert cost["step_ms"] == pytest.approx(25.0)
    assert cost["compute_ms"] == pytest.approx(20.0)
    assert cost["fixed_ms"] == pytest.approx(5.0)
    assert cost["phase_ms"] == pytest.approx({"compute": 20.0, "push": 2.0, "pull": 1.0})
    assert cost["phase_steps_from"] == "steady loop steps"
    assert cost["shard_ms"] == [pytest.approx({"handle": 1.0, "apply": 0.5})]
    # Loops too short for steady steps: their phases over the whole run.
    loop = SimpleNamespace(steps=16, steady_steps=0, phases={"compute": 16 * 0.020}, steady_phases={})
    cost = fixed_cost(SimpleNamespace(commit_times=times, loops=[loop], steps=16, shard_phases=[]), skip=5)
    assert cost["phase_steps_from"] == "loops" and cost["compute_ms"] == pytest.approx(20.0)
    # A loop that does not count its steps: the committed steps stand in; no compute phase, no figure.
    loop = SimpleNamespace(steps=0, steady_steps=0, phases={"forward": 16 * 0.020}, steady_phases={})
    cost = fixed_cost(SimpleNamespace(commit_times=times, loops=[loop], steps=16, shard_phases=[]), skip=5)
    assert cost["phase_steps_from"] == "commits" and cost["phase_ms"] == pytest.approx({"forward": 20.0})
    assert cost["compute_ms"] is None and cost["fixed_ms"] is None


def test_longest_gap_counts_the_gap_the_freeze_falls_in() -> None:
    times = [0.0, 0.1, 0.2, 2.5, 2.6, 2.7, 3.5, 3.6]
    assert longest_gap(times, after=1.0) == pytest.approx((2.3, 0.2))  # from the last commit before it
    assert longest_gap(times, after=2.6) == pytest.approx((0.8, 2.7))
    assert longest_gap(times, after=4.0) is None


def check_steady(r: dict[str, Any]) -> None:
    for w in ("cnn", "cnn-20", "transformer", "mlp"):
        assert r["steady"][w]["plain"] > 0 and r["steady"][w]["elastic"] > 0
        assert r["steady"][w]["plain_tuned"] > 0
        assert {x.get("allocator") for x in r["steady"][w]["runs"]} == {"default", "tuned", None}
        # Smoke runs are too short for periodic snapshots: only that the figures are there is checked.
        snap = r["snapshot"][w]
        assert all(math.isfinite(snap[k]) for k in ("in_run", "placebo", "window_s")), snap
        assert len(snap["pair_overheads"]) == 1
        cost = r["fixed_cost"][w]
        # Smoke runs are too short for a steady step: only that the figures are there is checked.
        assert math.isfinite(cost["fixed_ms"]) and cost["step_ms"] > 0 and cost["compute_ms"] > 0, cost
        assert len(cost["shard_ms"]) == 2 and all(s["handle"] > 0 for s in cost["shard_ms"]), cost
        assert cost["phase_ms"]["compute"] == cost["compute_ms"]
    # The mlp's 2.7 MB of gradients reach its shard through shared memory (`wire/inbox.py`), after the first.
    assert sum(b["shared"] for b in r["fixed_cost"]["mlp"]["shard_bodies"]) > 0, r["fixed_cost"]["mlp"]


def check_ddp(r: dict[str, Any]) -> None:
    ddp = r["ddp"]["cnn-20"]  # (smoke runs compare with DDP on cnn-20 only)
    assert ddp["ratio"] > 0 and len(ddp["pair_ratios"]) == 1, ddp
    assert {x["system"] for x in ddp["runs"]} == {"prefect-elastic", "torchrun-ddp"}


def check_recovery(r: dict[str, Any]) -> None:
    for policy in ("reassign", "rollback"):
        rec = r["recovery"][policy]
        assert rec["kills"] == 1 and rec["recovery_s"]["n"] == 1, rec
    # A SIGKILL under rollback undoes committed steps or drops the step in flight: work lost is counted.
    assert r["recovery"]["rollback"]["lost_steps_per_failure"] > 0
    assert r["recovery"]["reassign"]["steps_lost"] == [0]
    frozen = r["frozen"]["reassign"]  # (smoke runs freeze a worker under one policy only)
    assert frozen["frozen"] and frozen["longest_gap_s"] > 0, frozen
    assert frozen["cont_t"] > frozen["stop_t"]


def check_elastic(r: dict[str, Any]) -> None:
    assert set(r["calls"]["ms"]) == {"empty", "cnn share", "mlp share"}
    assert all(v > 0 for by in r["calls"]["ms"].values() for v in by.values())
    for w in ("cnn", "mlp"):
        assert [x["workers"] for x in r["scaling"][w]] == [1, 2]
    kinds = [e["kind"] for e in r["timeline"]["events"]]
    assert "kill" in kinds and "join" in kinds


def check_standby(r: dict[str, Any]) -> None:
    assert [s["server"] for s in r["memory"]["servers"]] == [0, 1]
    assert all(s["must_hold"] > s["data_bytes"] > 0 for s in r["memory"]["servers"])
    # What they must hold counts the replicas: each one's peer's shard (with its SGD momentum), which for
    # a model that lives on one data server (`min_shard_bytes`) is all on the other.
    servers = r["memory"]["servers"]
    assert sum(s["replica_bytes"] for s in servers) == 2 * sum(s["param_bytes"] for s in servers) > 0
    # A data server's static worker killed: promoted on a standby from the replica, and the baseline ran.
    promo, restart = r["standby"]["promotion"], r["standby"]["restart"]
    assert promo["promotions"] == promo["kills"] == 1 and promo["per_kill"][0]["source"] == "replica", promo
    assert restart["recovery_s"] > restart["fail_s"] > 0 and restart["resumed_from"], restart
    assert any("a standby promoted" in row[0] for row in figures(r))
    check_replicas(r)


def check_replicas(r: dict[str, Any]) -> None:
    cost = r["standby"]["replica_cost"]
    assert len(cost["ratios"]) == 1 and cost["pairs"][0]["snapshots_with"] > 0, cost


def check_async(r: dict[str, Any]) -> None:
    accuracy = r["async"]["accuracy"]  # (one run of each in a smoke run)
    assert [len(v) for v in accuracy["runs"].values()] == [1, 1] and 0 < accuracy["async"] <= 1, accuracy
    assert any("final accuracy" in row[0] for row in figures(r))


def check_tls(r: dict[str, Any]) -> None:
    for w in ("cnn-20", "mlp"):  # TLS on every connection against none, one pair each in a smoke run
        tls = r["tls"][w]
        assert len(tls["ratios"]) == 1 and tls["pairs"][0]["tls"] > 0 and tls["pairs"][0]["plain"] > 0, tls
    assert any("cost of TLS" in row[0] for row in figures(r))


def check_torchrun(r: dict[str, Any]) -> None:
    assert r["torchrun"]["recovery"] and r["torchrun"]["timeline"]["started"], r["torchrun"]["timeline"]
    assert r["torchrun"]["timeline"]["steps"]


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "steady": check_steady,
    "ddp": check_ddp,
    "recovery": check_recovery,
    "elastic": check_elastic,
    "standby": check_standby,
    "replicas": check_replicas,
    "async": check_async,
    "tls": check_tls,
    "torchrun": check_torchrun,
}


def test_every_group_of_the_suite_has_its_smoke_check() -> None:
    assert set(CHECKS) == set(GROUPS)


# A smoke run of one group of scenarios a CI run (a minute or two; the whole suite at smoke sizes took 9 to
# 14 minutes here), the group picked by the run's seed so that successive runs go round them all;
# `python -m benchmarks.run --smoke` runs every group at once.
SMOKE_GROUP = rotated(list(GROUPS), salt=1)


@pytest.mark.cluster
@pytest.mark.heavy  # (a minute or two, with clusters of its own)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", [SMOKE_GROUP])
def test_smoke_run_of_one_group_writes_its_figures_into_the_stored_ones(tmp_path: Path, group: str) -> None:
    raw = tmp_path / "results.json"
    stored = json.loads((ROOT / "docs" / "benchmarks" / "results.json").read_text())
    raw.write_text(json.dumps(stored))
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nintro kept\n\n{START}\nold table\n{END}\n\nanalysis kept\n")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--only", group,
         "--data-dir", str(tmp_path / "data"), "--raw", str(raw), "--docs", str(docs)],
        cwd=ROOT, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(raw.read_text())
    assert not r.get("errors")
    assert r["partial_runs"][-1]["only"] == group
    CHECKS[group](r)
    # The table has a row per figure, put between the marks; the text around them is kept.
    text = docs.read_text()
    assert "intro kept" in text and "analysis kept" in text and "old table" not in text
    for row in figures(r):
        assert f"| {row[0]} | {row[1]} |" in text
    for plot in ("bench-timeline", "bench-ratios", "bench-fixed-cost"):
        assert (tmp_path / "img" / f"{plot}.png").stat().st_size > 10_000


@pytest.mark.cluster
@pytest.mark.heavy  # (a minute or two on 2 cores; one of them a CI run, in turn: conftest.ROTATED_AXES)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tool", ["gpu-check", "user-model", "overlap-push", "overlap-pull"])
def test_a_benchmark_tool_runs(tmp_path: Path, tool: str) -> None:
    checks = {"gpu-check": check_the_gpu_check, "user-model": check_a_users_own_model}
    checks["overlap-push"] = check_the_overlap_push_benchmark
    checks["overlap-pull"] = check_the_overlap_pull_benchmark
    checks[tool](tmp_path)


def check_the_overlap_pull_benchmark(tmp_path: Path) -> None:
    """`python -m benchmarks.overlap_pull`: a compute worker in a network namespace of its own, its link
    shaped by tc, pulling whole and in buckets side by side (the bucket run must read buckets), the row
    written between the marks of the docs it is given, the text around kept."""
    from benchmarks.overlap_pull import END, START, main

    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"intro kept\n{START}\nold table\n{END}\nanalysis kept\n")
    args = ["--smoke", "--workloads", "mlp", "--repeats", "1", "--rate", "2gbit", "--docs", str(docs)]
    assert main([*args, "--workdir", str(tmp_path)]) == 0
    text = docs.read_text()
    assert "intro kept" in text and "analysis kept" in text and "old table" not in text
    (row,) = [line for line in text.splitlines() if line.startswith("| mlp |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0, row  # samples/s, whole and in buckets


def check_the_overlap_push_benchmark(tmp_path: Path) -> None:
    """`python -m benchmarks.overlap_push`: the whole push, the overlapped one and the plain loop side by
    side, their row written between the marks of the docs it is given, the text around kept."""
    from benchmarks.overlap_push import END, START, main

    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"intro kept\n{START}\nold table\n{END}\nanalysis kept\n")
    args = ["--smoke", "--workloads", "mlp", "--repeats", "1", "--docs", str(docs)]
    assert main([*args, "--data-dir", str(tmp_path)]) == 0
    text = docs.read_text()
    assert "intro kept" in text and "analysis kept" in text and "old table" not in text
    (row,) = [line for line in text.splitlines() if line.startswith("| mlp |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(c) > 0 for c in cells[1:7]), row  # samples/s and ratios of the three kinds
    assert all(float(ms) > 0 for ms in cells[7].split(" / ")), row  # the fixed costs, whole and overlapped


def check_the_gpu_check(tmp_path: Path) -> None:
    """`python -m benchmarks.gpu`, which a session lent a GPU runs there (CI has none): on this machine it
    trains on the CPU, and its check must still find what it looks for on CUDA."""
    from benchmarks.gpu import main

    args = ["--out", str(tmp_path), "--checks", "transformer", "--workloads", "mlp", "--seconds", "0.5"]
    assert main([*args, "--pairs", "1", "--async-epochs", "1", "--check-epochs", "1"]) == 0
    results = json.loads((tmp_path / "gpu.json").read_text())
    check = results["check"]["transformer"]
    assert "error" not in check, check.get("error")
    assert "error" not in results["steady"]["mlp"], results["steady"]["mlp"].get("error")
    assert check["reference_devices"] == ["cpu"]
    for policy in ("rollback", "reassign"):
        assert check[policy]["bitwise_equal"] and check[policy]["exactly_once"], check[policy]
        assert check[policy]["generations"] >= 2 and check[policy]["killed"], "a worker was killed"
    assert check["async"]["exactly_once"] and check["async"]["last_loss"] < check["async"]["first_loss"]
    steady = results["steady"]
    assert steady["mlp"]["ratio"] > 0 and steady["mlp"]["plain_deterministic_step_ms"] > 0
    assert steady["async-mlp"]["ratio"] > 0


def check_a_users_own_model(tmp_path: Path) -> None:
    """`python -m benchmarks.user_model` on a model written outside the repository (a folder of the
    user's, put on the workers' `PYTHONPATH`) and the user's own `.npz`: both sides train it, and a
    misnamed dataset is refused naming it."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "nets.py").write_text(
        "from torch import nn\n\n\ndef net():\n    return nn.Sequential(nn.Flatten(), nn.Linear(12, 3))\n"
    )
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((256, 3, 4)).astype(np.float32),
             y=rng.integers(0, 3, 256))  # fmt: skip
    args = ["--model", "nets:net", "--dataset", str(tmp_path / "data.npz"), "--path", str(tmp_path / "mine")]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.user_model", *args, "--batch", "16", "--pairs", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pair 1: plain" in done.stdout and "nets:net: " in done.stdout, done.stdout
    wrong = subprocess.run(
        [sys.executable, "-m", "benchmarks.user_model", "--model", "nets:net", "--dataset", "nowhere.npz"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert wrong.returncode == 2 and "--dataset nowhere.npz: no such file" in wrong.stderr


def test_recovery_is_judged_against_the_side_by_side_baseline_when_the_run_has_one() -> None:
    from benchmarks.report import BEFORE, no_worse_than_before

    stored = {"recovery_baseline": None}
    text, ok = no_worse_than_before(stored, "recovery_s", BEFORE["recovery_s"] + 0.01)
    assert not ok and "stored" in text, "without a comparison, the stored figure of before issue 9 judges"
    side = {"this": 0.5, "baseline": 0.6, "n": [15, 15], "ratio": 0.5 / 0.6, "pair_ratios": [0.8, 0.9]}
    run = {"recovery_baseline": {"baseline": "e33f498", "recovery_s": side}}
    text, ok = no_worse_than_before(run, "recovery_s", 0.5)
    assert ok and "side by side" in text and "0.83" in text, "a slower machine is not held against this code"
    slower = {**side, "ratio": 1.07}
    text, ok = no_worse_than_before(
        {"recovery_baseline": {"baseline": "e33f498", "recovery_s": slower}}, "recovery_s", 0.1
    )
    assert not ok, "slower than the baseline in the same run: missed, however small the absolute figure"


def test_a_baseline_commit_that_is_not_in_the_history_is_named(tmp_path: Path) -> None:
    from benchmarks.baseline import extract

    with pytest.raises(ValueError, match=r"'no-such-commit'.*name a commit of its history"):
        extract("no-such-commit", tmp_path)
    assert not list(tmp_path.iterdir()), "nothing extracted"


def test_a_scaling_run_has_whole_batches_on_every_data_server_for_its_steps() -> None:
    for steps, workers, servers in [(12, 1, 1), (12, 2, 4), (30, 4, 4), (13, 8, 2), (30, 1, 4)]:
        samples = samples_for(steps, workers, servers, batch=32)
        assert samples % (servers * 32) == 0, "equal partitions of whole batches"
        schedule = Schedule((samples // servers,) * servers, 32, workers, epochs=1, seed=0)
        assert steps <= schedule.total_steps < steps + servers, (steps, workers, servers)


def test_the_fixed_cost_model_recovers_a_line_and_predicts_from_it() -> None:
    param_bytes = 45_000_000
    # Fixed costs of exactly 10 ms + 0.5 ms per MB a data server takes in a step.
    configs = [(n, s) for n in (1, 2, 4) for s in (1, 2, 4)]
    points = [
        (shard_load_mb(n, s, param_bytes), 10 + 0.5 * shard_load_mb(n, s, param_bytes)) for n, s in configs
    ]
    model = fit_fixed_cost(points)
    assert model.base_ms == pytest.approx(10) and model.per_mb_ms == pytest.approx(0.5)
    assert model.points == 9
    at64 = predict(model, compute_ms=100, workers=64, servers=4, param_bytes=param_bytes, batch=32)
    assert at64.fixed_ms == pytest.approx(10 + 0.5 * 64 * 45 / 4)
    assert at64.step_ms == pytest.approx(100 + at64.fixed_ms)
    assert at64.samples_per_s == pytest.approx(64 * 32 / (at64.step_ms / 1000))
    # Efficiency: 64 workers' throughput over 64 times one worker's, both from the model.
    assert at64.efficiency == pytest.approx((100 + 10 + 0.5 * 45 / 4) / at64.step_ms)
    # More data servers take the load off each: the same 64 workers scale better.
    at64_wider = predict(model, compute_ms=100, workers=64, servers=16, param_bytes=param_bytes, batch=32)
    assert at64_wider.efficiency > at64.efficiency
    with pytest.raises(ValueError, match="at least two loads"):
        fit_fixed_cost([(45.0, 12.0), (45.0, 14.0)])


def test_a_configurations_row_is_measured_against_one_worker_and_the_plain_loop() -> None:
    one = {"workers": 1, "samples_per_s": 100.0, "step_ms": 320.0, "compute_ms": 290.0}
    two = {"workers": 2, "samples_per_s": 180.0, "step_ms": 355.0, "compute_ms": 300.0}
    plain = {"samples_per_s": 110.0, "step_ms": 290.0}
    row = config_figures(two, one, plain)
    assert row["efficiency"] == pytest.approx(0.9)
    assert row["over_plain"] == pytest.approx(180 / 220)
    assert row["fixed_over_plain_ms"] == pytest.approx(65.0) and row["fixed_ms"] == pytest.approx(55.0)
    assert config_figures(one, one, plain)["efficiency"] == pytest.approx(1.0)
    assert config_figures(two, None, plain)["efficiency"] is None, "no one-worker run: no efficiency"
    # Of repeats, the one of the median step stands for the configuration (of two, the faster).
    assert median_repeat([900.0, 300.0, 450.0]) == 2
    assert median_repeat([900.0, 300.0]) == 1 and median_repeat([300.0]) == 0


@pytest.mark.cluster
@pytest.mark.heavy  # (under a minute on a quiet machine: one cluster, two short jobs of the mlp)
@pytest.mark.timeout(600)
def test_the_scaling_benchmark_writes_its_table_plot_and_prediction(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(
        f"# Benchmarks\n\nintro kept\n\n{SCALING_START}\nold table\n{SCALING_END}\n\nanalysis kept\n"
    )
    raw = tmp_path / "benchmarks" / "scaling.json"
    args = ["--workload", "mlp", "--workers", "1,2", "--data-servers", "2", "--steps", "12"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.scaling", *args,
         "--data-dir", str(tmp_path / "data"), "--raw", str(raw), "--docs", str(docs)],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(raw.read_text())
    assert [(c["servers"], c["workers"]) for c in r["configs"]] == [(2, 1), (2, 2)]
    for c in r["configs"]:
        f = c["figures"]
        assert f["samples_per_s"] > 0 and f["plain_step_ms"] > 0 and math.isfinite(f["fixed_ms"]), f
        assert c["devices"] == ["cpu"] and len(c["runs"][0]["shard_ms"]) == 2, (
            "both data servers hold parameters"
        )
    assert r["configs"][0]["figures"]["efficiency"] == pytest.approx(1.0)
    assert r["model"] is not None, r.get("model_error")
    assert {p["workers"] for p in r["predictions"]} == {64}
    text = docs.read_text()
    assert "intro kept" in text and "analysis kept" in text and "old table" not in text
    assert "| 2 | 2 |" in text and "| predicted: data servers" in text
    assert (tmp_path / "img" / "bench-scaling.png").stat().st_size > 10_000
