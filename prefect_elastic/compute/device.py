"""Where a compute worker's micro-batches run, and how fast: its device (`training_device`, with the
settings that keep a micro-batch's gradient the same bits on every worker), the seed of a micro-batch's
random ops (`micro_batch_seed`), and the straggler's slowdown that tests and benchmarks plug in
(`SLOWDOWN`, `straggle`)."""

from __future__ import annotations

import os
import time

import torch

# The name of a Dask worker plugin with a `factor` attribute that, where present, makes this worker's
# compute that many times slower (a straggler for tests and benchmarks: `prefect_elastic.local.slow`).
SLOWDOWN = "prefect-elastic-slowdown"


def straggle(plugin: object | None, took: float) -> None:
    """Where this worker is made a straggler (a `SLOWDOWN` plugin with a `factor`), take `factor` times as
    long as the compute that just took `took` seconds."""
    factor = float(getattr(plugin, "factor", 1.0)) if plugin is not None else 1.0
    if factor > 1.0:
        time.sleep((factor - 1.0) * took)


def training_device(deterministic: bool = True) -> torch.device:
    """The device a compute worker trains on: its GPU where it has one, with deterministic kernels
    (`deterministic`, the job's setting; False: the fastest ones, and no bitwise guarantee).

    A micro-batch must give the same gradient bits on every worker (invariant 2: the result is bitwise
    equal to the one-worker, no-fault run). On CPU it does; on CUDA, cuDNN may pick a different algorithm
    from one call to the next (`benchmark`), some backward kernels sum with atomics in whatever order
    threads finish, and cuBLAS does so across streams unless its workspace is fixed. These settings are
    the process's, so every job's loop in this worker shares them; an op with no deterministic CUDA
    kernel warns (rather than failing the user's model) and then bitwise equality is not promised.
    Bits are the same across workers of one GPU model and software stack, not across models. Without
    (`deterministic=False`): cuDNN's autotuner picks the fastest algorithm per shape, and nothing holds
    the kernels to one summation order.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # Read when cuBLAS makes its first handle, once per process: set whatever the job, so that a
    # deterministic job after one that is not, in the same worker, still has it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    # (That setting also fills every new tensor with NaN, host buffers included: a pass over the receive
    # buffers of each step for nothing, since the step overwrites them.)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    return torch.device("cuda")


def micro_batch_seed(seed: int, batch_id: int) -> int:
    """The seed of the random ops of one micro-batch: a function of the job's seed and the batch id only."""
    return (seed * 1_000_003 + batch_id) % (2**63)
