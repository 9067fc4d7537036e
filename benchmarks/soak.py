"""The longer chaos soak: the soak tests of tests/test_chaos.py with more rounds of faults, their figures
written into docs/faults.md (between the soak marks).

    python -m benchmarks.soak               # 10 rounds: 110 faults in each of the three runs
    python -m benchmarks.soak --rounds 20

It runs pytest (the soak asserts the invariants as it does in CI) with `ELASTIC_SOAK_ROUNDS` and
`ELASTIC_SOAK_FIGURES` set, and fails if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefect_elastic.local.forkserver import FORK_SERVER_ENV

from .report import replace_between

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- soak:start (written by python -m benchmarks.soak; edit outside these marks) -->"
END = "<!-- soak:end -->"


def table(runs: list[dict[str, Any]], rounds: int, *, forked: bool, load: float) -> str:
    started = (
        "the workers outside network namespaces forked from a fork server, as the test suite's are"
        if forked
        else "every worker started as a plain process"
    )
    lines = [
        f"Made by `python -m benchmarks.soak --rounds {rounds}` (2 cores, no GPU; {started}; a 1-minute "
        f"load average of {load:.1f} before it began): each run one training job, every invariant asserted "
        "at its end.",
        "",
        "| run | faults survived | worker processes | steps | membership changes | promotions (data "
        "servers': seconds each, seen lost to in place) | steps undone | time without a commit | longest "
        "stall | run time | goodput | without a commit, by cause |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in runs:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(f["by_kind"].items()))
        took = sorted(sum(parts.values()) for parts in f.get("promotion_parts", []))
        promotions = f"{f['promotions']} ({took[0]:.2f} to {took[-1]:.2f})" if took else str(f["promotions"])
        lines.append(
            f"| {f['mode']}, {f['policy']} | {f['faults']} ({kinds}) | {f['processes']} | {f['steps']} | "
            f"{f['membership_changes']} | {promotions} | {f['steps_lost']} | "
            f"{sum(f['stalls']):.1f} s in {len(f['stalls'])} stalls | {f['longest_stall']:.2f} s | "
            f"{f['elapsed']:.0f} s | {1 - sum(f['stalls']) / f['elapsed']:.2f} | "
            + ", ".join(
                f"{cause} {seconds:.1f} s" for cause, seconds in f.get("causes", {}).items() if seconds
            )
            + " |"
        )
    lines += ["", "The longest stalls, with the faults and then what survival detection did within each:", ""]
    for f in runs:
        lines += [f"- {f['mode']}, {f['policy']}: " + "; ".join(f["worst"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of faults per run (10 faults each)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "faults.md")
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error(f"--rounds {args.rounds}: the soak asserts at least 50 faults a run, so give 5 or more")
    load = os.getloadavg()[0]  # (others' work on the machine: the soak alone keeps both cores busy)
    forked = os.environ.get(FORK_SERVER_ENV, "1") == "1"  # (tests/conftest.py's default)
    with tempfile.TemporaryDirectory(prefix="prefect-elastic-soak-") as folder:
        out = Path(folder) / "figures.jsonl"
        env = {
            **os.environ,
            "ELASTIC_SOAK_ROUNDS": str(args.rounds),
            "ELASTIC_SOAK_FIGURES": str(out),
            "ELASTIC_ALL_CASES": "1",  # the three runs, not the one a CI seed picks
        }
        command = [sys.executable, "-m", "pytest", "-q", "-m", "heavy", "-k", "soak", "tests/test_chaos.py"]
        print("running", " ".join(command), f"with {args.rounds} rounds", flush=True)
        code = subprocess.call(command, cwd=ROOT, env=env)
        runs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if code != 0:
        print(f"the soak failed (pytest exit code {code}); docs not written", file=sys.stderr)
        return code
    replace_between(args.docs, START, END, table(runs, args.rounds, forked=forked, load=load))
    print(f"wrote the figures of {len(runs)} runs into {args.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
