"""The sizes of the benchmark suite's scenarios (`Sizes`: how many samples, epochs, repeats, kills), and
the tiny ones of its smoke run (`SMOKE`), whose numbers mean nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import standby


@dataclass(frozen=True)
class Sizes:
    samples: int = 16384  # 128 steps of 128 per epoch
    memory_samples: int = 60000  # a data server must hold 94 MB of it
    # Epochs of a steady-state run, by workload: a run of each long enough to hold about 20 snapshots (its
    # length, and how it moves with the machine: docs/benchmarks.md, "How each figure is measured").
    steady_epochs: tuple[tuple[str, int], ...] = (("cnn", 1), ("cnn-20", 5), ("transformer", 5), ("mlp", 10))
    # The workloads of the bench extra, measured only when named (`--workloads`), on data of their own shape
    # of `extra_samples` samples: the resnet18, 128 steps of 32 an epoch (its plain step: docs/benchmarks.md,
    # "Models and data from outside this repository").
    extra_steady_epochs: tuple[tuple[str, int], ...] = (("resnet18", 2),)
    extra_samples: int = 4096
    repeats: int = 3  # runs of each steady-state figure, interleaved; medians are reported
    # The same for the light workloads: their ratio over plain lies within this machine's noise of its
    # target (docs/benchmarks.md, "What the figures say": this machine drifts).
    light_repeats: int = 7
    light: tuple[str, ...] = ("cnn-20", "transformer")
    # 2 compute workers against torchrun DDP with 2 processes: epochs of 64 steps of 2 x 128 samples (the
    # resnet18, named with `--workloads`: 64 steps of 2 x 32 of `extra_samples` CIFAR-shaped samples).
    ddp_epochs: tuple[tuple[str, int], ...] = (("cnn-20", 8), ("cnn", 2))
    extra_ddp_epochs: tuple[tuple[str, int], ...] = (("resnet18", 1),)
    ddp_repeats: int = 3
    kills: int = 5
    recovery_epochs: int = 8
    # Recovery and scale-up side by side with the code before issue 9 (`--baseline`): alternating pairs of
    # runs, each on a cluster of its own, `kills` SIGKILLs each; 4 epochs hold the 5 kills with room to spare.
    baseline_pairs: int = 3
    baseline_epochs: int = 4
    # Frozen worker: SIGSTOP after `frozen_settle` steps together, SIGCONT `freeze_s` s later.
    frozen_epochs: int = 12
    freeze_s: float = 8.0
    frozen_settle: int = 20
    frozen_policies: tuple[str, ...] = ("reassign", "rollback")
    # A data server's static worker SIGKILLed, a standby promoted (issue 10): kills in one run of the cnn.
    standby_kills: int = 5
    standby_epochs: int = 7  # 5 epochs ended before the 5th kill (4 measured)
    standby_settle: int = 30  # steps on a placement, and a snapshot of half-way, before the next kill
    standby_ready_s: float = standby.STANDBY_READY_S  # a standby listed this long before a kill onto it
    restart_epochs: int = 1
    coordinator_kills: int = 5
    restore_repeats: int = 5  # a 200 MB shard from the peer's memory, and from a checkpoint file
    restore_model: str = "benchmarks.workloads:wide_mlp"  # (the 200 MB shard)
    replica_epochs: int = 5  # of cnn-20 (a run's length: docs/benchmarks.md, "How each figure is measured")
    # The pairs spread by more than the replicas cost (docs/benchmarks.md, "Standby static workers"): more
    # pairs than 3 steady the median, not enough
    replica_repeats: int = 5
    scaling_workers: tuple[int, ...] = (1, 2, 4)
    scaling_epochs: int = 3
    timeline_epochs: int = 6
    kill_at: float = 4.0
    join_at: float = 8.0
    torchrun_duration: float = 40.0  # s after its first step, as kill_at and join_at
    call_repeats: int = 200
    # Async mode (issue 11): 4 compute workers, one 3x slower, sync against async to a target loss; and 1
    # worker in async mode over the plain loop (mlp, communication-bound).
    # (the transformer: a light step, and its loss falls within the run; cnn-20's hardly moves in 4 epochs
    # of the synthetic data)
    straggler_workload: str = "transformer"
    straggler_workers: int = 4
    straggler_epochs: int = 4
    straggler_repeats: int = 1
    async_steady_epochs: int = 10
    async_steady_repeats: int = 3
    # Final accuracy, async against sync, on held-out digits (same data and epochs, 4 compute workers):
    # 20 epochs, where sync has converged and async has caught up (docs/benchmarks.md, "Async mode").
    accuracy_workers: int = 4
    accuracy_epochs: int = 20
    accuracy_repeats: int = 3
    # TLS on every connection against none (steady, 1 worker), alternating pairs.
    tls_epochs: dict[str, int] = field(default_factory=lambda: {"cnn-20": 3, "mlp": 6})
    tls_repeats: int = 3


SMOKE = Sizes(
    samples=2048,
    memory_samples=4096,  # must differ from samples: the memory figure compares the two
    steady_epochs=(("cnn", 1), ("cnn-20", 1), ("transformer", 1), ("mlp", 1)),
    extra_steady_epochs=(("resnet18", 1),),
    extra_samples=1024,  # 32 steps of the resnet18
    repeats=1,
    light_repeats=1,
    ddp_epochs=(("cnn-20", 2),),  # 16 steps: a throughput needs more than 5 after the first
    ddp_repeats=1,
    kills=1,
    recovery_epochs=4,
    baseline_pairs=0,  # (a smoke run checks this code, not an older one)
    frozen_epochs=20,  # long enough for a freeze of 3 s to start and end inside the run
    freeze_s=3.0,
    frozen_settle=5,
    frozen_policies=("reassign",),
    scaling_workers=(1, 2),
    scaling_epochs=2,
    timeline_epochs=3,
    kill_at=0.3,
    standby_kills=1,
    standby_epochs=8,  # 64 steps: the kill comes after about 10, and its recovery takes about as many
    standby_settle=6,
    standby_ready_s=1.0,
    restart_epochs=5,  # 40 steps: the kill (at step 6) comes well before the end
    coordinator_kills=1,
    restore_repeats=1,
    restore_model="benchmarks.workloads:wide_mlp_smoke",
    replica_epochs=2,
    replica_repeats=1,
    join_at=0.6,
    torchrun_duration=14.0,
    call_repeats=5,
    straggler_epochs=1,
    straggler_workers=2,
    async_steady_epochs=1,
    async_steady_repeats=1,
    accuracy_workers=2,
    accuracy_epochs=1,
    accuracy_repeats=1,
    tls_epochs={"cnn-20": 1, "mlp": 1},
    tls_repeats=1,
)
