"""Recovery and scale-up side by side with an older commit of this repository, in one run.

Issue 9's recovery and scale-up targets are "no worse than before the issue". This machine's speed drifts
from hour to hour (docs/benchmarks.md, "How each figure is measured": against an older commit), so a
figure stored from an earlier day says little: both codes run here, alternating, and the result is a ratio.

Each run is a subprocess whose `PYTHONPATH` starts with one tree: this checkout, or the older commit
extracted with `git archive`. It calls that tree's own `benchmarks.elastic.recovery` (the function, and
so the measure, is the same in both: from a SIGKILL to the next committed step; from the scheduler's
registration of the worker that comes back to its first committed batch) on a cluster of its own, whose
worker processes import the same tree. Each run reports where its controller and its workers imported
`prefect_elastic` from, and that is checked: a run of the wrong code would compare nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The last commit before issue 9's step path (docs/benchmarks.md of 2026-11-21 measured it).
BEFORE_ISSUE_9 = "e33f498"
RESULT_MARK = "RECOVERY-RESULT "  # the line of a run's output that holds its result, as JSON

# Run inside the subprocess, against whichever tree its PYTHONPATH names first.
_RUNNER = """
import json, sys
import prefect_elastic
from benchmarks import elastic

workload, data, policy, kills, epochs = json.loads(sys.argv[1])


def where() -> str:
    import prefect_elastic

    return prefect_elastic.__file__


pool = elastic.ClusterPool()
try:
    result = elastic.recovery(pool, workload, data, policy, kills, epochs)
    with pool.cluster.client(set_as_default=False) as client:
        result["worker_imports"] = sorted(set(client.run(where).values()))
finally:
    pool.close()
result["controller_imports"] = prefect_elastic.__file__
print("%s" + json.dumps(result), flush=True)
"""


def extract(commit: str, into: Path) -> Path:
    """The tree of `commit` of this repository, extracted under `into` (once per commit)."""
    full = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{commit}^{{commit}}"],
        capture_output=True, text=True,
    )  # fmt: skip
    if full.returncode != 0:
        raise ValueError(
            f"baseline commit {commit!r} is not in the repository at {ROOT} ({full.stderr.strip()}); "
            "name a commit of its history (a full clone holds them all)"
        )
    sha = full.stdout.strip()
    tree = into / f"baseline-{sha[:12]}"
    if not tree.exists():
        into.mkdir(parents=True, exist_ok=True)
        # Extracted beside it, then renamed: a tree cut short by an interrupted run is never used.
        with tempfile.TemporaryDirectory(dir=into, prefix=f"{tree.name}.") as scratch:
            archive = Path(scratch) / "tree.tar"
            subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), sha], check=True)
            with tarfile.open(archive) as tar:
                tar.extractall(Path(scratch) / "tree", filter="data")
            (Path(scratch) / "tree").rename(tree)
    return tree


def run_in(tree: Path, workload: str, data: str, policy: str, kills: int, epochs: int) -> dict[str, Any]:
    """One recovery run with the code of `tree`, in a process of its own."""
    paths = [str(tree), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER % RESULT_MARK, json.dumps([workload, data, policy, kills, epochs])],
        cwd=tree, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"recovery run in {tree} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_MARK) :])
    imports = [result["controller_imports"], *result["worker_imports"]]
    strays = [path for path in imports if not Path(path).resolve().is_relative_to(tree.resolve())]
    if strays:
        raise RuntimeError(f"a recovery run meant for {tree} imported prefect_elastic from {strays}")
    return result


def _pooled(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [v for run in runs if run.get(key) for v in run[key]["values"]]


def side_by_side(
    commit: str, workdir: Path, data: str, pairs: int, kills: int, epochs: int, workload: str = "cnn"
) -> dict[str, Any]:
    """`pairs` recovery runs of this checkout and of `commit`, alternating (this one first in odd pairs,
    the baseline in even ones), `kills` SIGKILLs each, policy reassign. Recovery and scale-up are pooled
    over every kill of a side; the ratios are this checkout's medians over the baseline's (below 1:
    faster now)."""
    base = extract(commit, workdir)
    sides: dict[str, list[dict[str, Any]]] = {"this": [], "baseline": []}
    for pair in range(pairs):
        order = [("this", ROOT), ("baseline", base)]
        for side, tree in order if pair % 2 == 0 else reversed(order):
            print(f"  recovery pair {pair + 1} of {pairs}: {side} ({tree})", flush=True)
            sides[side].append(run_in(tree, workload, data, "reassign", kills, epochs))
    out: dict[str, Any] = {
        "baseline": commit,
        "trees": {"this": str(ROOT), "baseline": str(base)},
        "workload": workload,
        "pairs": pairs,
        "kills_per_run": kills,
    }
    for key in ("recovery_s", "scale_up_s"):
        now, then = _pooled(sides["this"], key), _pooled(sides["baseline"], key)
        out[key] = {
            "this": statistics.median(now) if now else None,
            "baseline": statistics.median(then) if then else None,
            "n": [len(now), len(then)],
            "ratio": statistics.median(now) / statistics.median(then) if now and then else None,
            # Each pair's ratio of medians: how much the comparison moves from one pair to the next.
            "pair_ratios": [
                a[key]["median"] / b[key]["median"]
                for a, b in zip(sides["this"], sides["baseline"], strict=True)
                if a.get(key) and b.get(key)
            ],
        }
    out["median_step_s"] = {side: [run["median_step_s"] for run in runs] for side, runs in sides.items()}
    return out
