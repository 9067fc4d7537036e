"""How often the coordinator reads the shards' status: a pure function of the pace of the last steps.

Each read is a Dask call to every shard, on processes that share the machine with the compute workers: 20
reads a second slowed a 20 ms CNN step by 4 to 6% on a 2-core machine (docs/benchmarks.md, issue 9). So a
sync job's steady state reads less often, and everything that waits on a read (re-queued batch ids, the
job's end, a caller that acts on steps as they commit) is read often.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Where something waits on the read, and a sync job's steady state.
SYNC_SECONDS = 0.05
STEADY_SYNC_SECONDS = 0.25
# The last steps whose pace `read_interval` takes for the pace to come.
PACE_STEPS = 20


def read_interval(commit_times: Sequence[float], remaining_steps: int, quick: float, steady: float) -> float:
    """`steady` while a job runs far from its end, else `quick`: before the pace of steps is known (fewer
    than two commit times of this run among the last `PACE_STEPS`), and where the job may end within two
    steady waits at the pace of its last steps (its end is then seen at once, not up to `steady` late).
    `commit_times`: when each step committed, nan for a step resumed from a checkpoint."""
    times = [t for t in commit_times[-PACE_STEPS:] if not math.isnan(t)]
    if len(times) < 2 or times[-1] <= times[0]:
        return quick
    step_seconds = (times[-1] - times[0]) / (len(times) - 1)
    return steady if remaining_steps * step_seconds > 2 * steady else quick
