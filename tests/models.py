"""Small model factories that tests name by import path (`tests.models:mlp`), as a user's job would.

Each returns a fresh `torch.nn.Module` for the 8x8 digits (input (N, 1, 8, 8), 10 classes), or, on purpose,
something broken that an error path must report; `char_lm` is for the token dataset (`tokens_url`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from torch import nn


def _mlp_layers() -> list[nn.Module]:
    return [nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)]


def mlp() -> nn.Module:
    return nn.Sequential(*_mlp_layers())


def cnn_bn() -> nn.Module:
    # BatchNorm has buffers (running stats) besides parameters; tests use it to check those travel too.
    return nn.Sequential(
        nn.Conv2d(1, 4, kernel_size=3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
    )


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom from the model")


def raises() -> nn.Module:
    return _Raises()


def not_a_module() -> int:
    return 42


class _NanModel(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * float("nan")


def nan_model() -> nn.Module:
    return _NanModel(*_mlp_layers())


class _SlowMlp(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The sleep paces cluster tests so that workers can be killed or added mid-training.
        time.sleep(0.004)
        return super().forward(x)


def slow_mlp() -> nn.Module:
    # Built from mlp()'s layers, so the same seed gives the same parameters under the same names.
    return _SlowMlp(*_mlp_layers())


class _PacedMlp(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Slower still: leaves a new worker process time to start and join while training runs.
        time.sleep(0.012)
        return super().forward(x)


def paced_mlp() -> nn.Module:
    return _PacedMlp(*mlp())


class _TiedDropout(nn.Module):
    """Tied weights, dropout and a non-persistent buffer: features that trip up a parameter server."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 16)
        self.hidden = nn.Linear(16, 16)
        self.again = nn.Linear(16, 16, bias=False)
        self.again.weight = self.hidden.weight  # tied
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, 10)
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x.flatten(1)))
        h = self.drop(torch.relu(self.hidden(h)))
        h = torch.relu(self.again(h)) * self.scale
        return self.out(h)


def tied_dropout() -> nn.Module:
    return _TiedDropout()


TOKENS = 20  # the vocabulary of `char_lm` and of the tests' token dataset (`tests/conftest.py`)


class _CharLM(nn.Module):
    """A language model over tokens: integer inputs (N, T), an embedding with a padding row, a two-layer
    LSTM (its weights one flat buffer inside cuDNN-style RNN code), dropout between its layers, LayerNorm,
    and an output layer tied to the embedding. Targets (N, T): the next token at every position."""

    def __init__(self, vocab: int = TOKENS, dim: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True, dropout=0.2)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(x))
        return self.out(self.norm(h))


def char_lm() -> nn.Module:
    return _CharLM()


def sequence_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at every position of (N, T, vocab) logits against (N, T) next tokens."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _signal_file(variable: str) -> Path:
    # tests/conftest.py names a file in a folder made fresh for each test session; the processes the tests
    # start (cluster workers, flow runs) inherit the variable. Never a fixed path: two test runs on one
    # machine would open each other's gates.
    value = os.environ.get(variable)
    if not value:
        raise RuntimeError(
            f"{variable} is not set: tests/conftest.py sets it for the test session, and the processes it "
            "starts inherit it; import tests.models from a pytest run"
        )
    return Path(value)


# While this file exists, every forward pass waits (at most two minutes): a test holds training at a step
# of its choosing until something it waits for (a new worker joining) has happened.
GATE = _signal_file("ELASTIC_TESTS_GATE")


def _wait_at_gate() -> None:
    # A file is the only signal every worker process can see; polled, and bounded so nothing hangs.
    deadline = time.monotonic() + 120
    while GATE.exists() and time.monotonic() < deadline:
        time.sleep(0.005)


class _GatedSlowMlp(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _wait_at_gate()
        # Paced like slow_mlp: steps do not race the faults and the test's gate (unpaced, the shards ran up
        # to 14 steps ahead of the progress a test watches in CI, and a job could end before its gate closed).
        time.sleep(0.004)
        return super().forward(x)


def gated_slow_mlp() -> nn.Module:
    return _GatedSlowMlp(*mlp())


def _wait_marked() -> None:
    """Where the gate is closed: say so with a mark named by this process (`waiting_marks`), and wait."""
    if not GATE.exists():
        return
    mark = GATE.with_name(f"{GATE.name}.waiting-{os.getpid()}")
    mark.write_text(str(time.monotonic_ns()))  # (when it began to wait: one clock for the machine)
    try:
        _wait_at_gate()
    finally:
        mark.unlink(missing_ok=True)


def waiting_marks() -> list[Path]:
    """The marks of the processes waiting in `second_forward_gated_mlp`'s gate, one per process."""
    return sorted(GATE.parent.glob(f"{GATE.name}.waiting-*"))


def _second_of_its_share() -> bool:
    """Whether the micro-batch being computed is the second of its member's share, where the gate file
    holds the number of members M of a job of 2M micro-batches a step: micro-batch j of a step goes to rank
    j % M (`Schedule.share`), so the second of each share is j >= M. The batch id is read off the seed of
    the micro-batch's random ops (`micro_batch_seed`: job seed x 1,000,003 + batch id), not counted: a
    count of forward calls shifts with any forward that is not one of a share's (a step dropped after its
    first micro-batch), and the gate would then hold the first micro-batch instead."""
    try:
        members = int(GATE.read_text() or "0")
    except (FileNotFoundError, ValueError):
        return False
    batch = torch.initial_seed() % 1_000_003
    return members > 0 and batch % (2 * members) >= members


class _SecondForwardGated(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1  # (forwards of this model, a loop's own: a test reads it)
        if _second_of_its_share():
            # The share's first micro-batch went through backward (its gradients left, where they leave
            # during backward): wait, with a mark.
            _wait_marked()
        time.sleep(0.004)
        return super().forward(x)


def second_forward_gated_mlp() -> nn.Module:
    """The mlp, waiting at the gate in the second micro-batch of each member's share
    (`_second_of_its_share`): with a share of two micro-batches a step, the gate holds each member between
    its two micro-batches."""
    return _SecondForwardGated(*mlp())


class _BackwardGate(torch.autograd.Function):
    """The identity; its backward waits at the gate, with a mark (`_wait_marked`), where `wait`."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, wait: bool) -> torch.Tensor:
        ctx.wait = wait  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.wait:  # type: ignore[attr-defined]
            _wait_marked()
        return grad, None


class _BackwardGatedMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU())
        # Nearly all the bytes (1.3 MB) lie past the gate: several buckets of each shard hold none of the
        # first layer's parameters.
        self.rest = nn.Sequential(
            nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.004)
        return self.rest(_BackwardGate.apply(self.first(x), _second_of_its_share()))


def big_mlp() -> nn.Module:
    """An mlp of 19 MB (a 16.8 MB first layer), over the size from which the engine may send gradients during
    backward (`compute.bucket_push.OVERLAP_MIN_BYTES`)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 65536), nn.ReLU(), nn.Linear(65536, 10))


def wide_mlp() -> nn.Module:
    """An mlp of 1.3 MB, nearly all past its first layer: each shard's parameters make several buckets."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 256),
        nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip


class _ReadsChildWeight(nn.Module):
    """A parent module that reads its child's weight in its own forward, before the child's forward ran
    (as `nn.MultiheadAttention` reads `out_proj.weight`): the child's pre-hook comes too late for it, so
    the parent's waits for it (`compute/buckets.unguarded`)."""

    def __init__(self) -> None:
        super().__init__()
        # (`proj.weight`, 1 MB, is a bucket of its own, which the parent reads before `proj` runs.)
        self.inp = nn.Linear(64, 512)
        self.proj = nn.Linear(512, 512)
        self.out = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x.flatten(1)))
        h = torch.relu(nn.functional.linear(h, self.proj.weight) + self.proj(h))
        return self.out(h)


def reads_child_weight() -> nn.Module:
    return _ReadsChildWeight()


def backward_gated_mlp() -> nn.Module:
    """An mlp whose backward waits at the gate in the second micro-batch of each member's share
    (`_second_of_its_share`), after the gradients of every layer but the first are computed: with a share
    of two micro-batches a step, each member waits in its last backward with the buckets of the later
    layers sent."""
    return _BackwardGatedMlp()


class _EnvPacedMlp(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _wait_at_gate()
        # Paced only where the cluster sets the variable (the chaos soak's workers), so that a one-worker
        # reference run of the same job is fast; a sleep changes no bit of the result.
        time.sleep(float(os.environ.get("ELASTIC_TESTS_PACE_S", "0")))
        return super().forward(x)


def env_paced_mlp() -> nn.Module:
    return _EnvPacedMlp(*_mlp_layers())


# While this file exists, the next forward pass removes it and raises: a failure that a retry outlives.
FAIL_ONCE = _signal_file("ELASTIC_TESTS_FAIL_ONCE")


class _FailsOnce(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            FAIL_ONCE.unlink()
        except FileNotFoundError:
            time.sleep(0.004)
            return super().forward(x)
        raise RuntimeError("a transient failure, injected by the test")


def fails_once() -> nn.Module:
    return _FailsOnce(*mlp())


# While this file exists, a compute loop's model closes the gate (`GATE`) at its 9th forward pass: a test
# arms it before a run, and training then stands at a step of at least 4 (2 workers, 4 micro-batches) until
# the test opens the gate (removing this file first), however fast training is. Standing still, the job is
# snapshotted once where it stands (checkpointed there with checkpoint_every=1).
HOLD = _signal_file("ELASTIC_TESTS_HOLD")
HOLD_AFTER_FORWARDS = 8


class _HeldFailsOnce(_FailsOnce):
    """Held at the gate once armed (`HOLD`), then fails once where the test put `FAIL_ONCE`."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.forwards = 0  # of this instance: every compute loop builds its own model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.forwards > HOLD_AFTER_FORWARDS and HOLD.exists():
            GATE.touch()
        _wait_at_gate()
        return super().forward(x)


def held_mlp() -> nn.Module:
    return _HeldFailsOnce(*mlp())


# The address of one compute worker on which the model always raises (a broken GPU, a bad driver on one
# host), written by a test; the model trains normally on every other worker.
BAD_WORKER = _signal_file("ELASTIC_TESTS_BAD_WORKER")


class _FailsOnOneWorker(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from distributed import get_worker

        try:
            bad = BAD_WORKER.read_text().strip()
        except FileNotFoundError:
            bad = ""
        if bad and get_worker().address == bad:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected here)")
        time.sleep(0.004)  # paced like slow_mlp: the bad worker takes its share before the good one is done
        return super().forward(x)


def fails_on_one_worker() -> nn.Module:
    return _FailsOnOneWorker(*mlp())


# For the test that two jobs built in threads of one process do not disturb each other's initial parameters:
# `pausing_mlp`'s constructor draws its first layer, then (when `PAUSE_IN_CONSTRUCTOR` is set) says so and
# waits a moment before its second, leaving another thread that moment to draw from torch's generator.
PAUSE_IN_CONSTRUCTOR = threading.Event()
PAUSED = threading.Event()


def pausing_mlp() -> nn.Module:
    first = nn.Linear(64, 32)
    if PAUSE_IN_CONSTRUCTOR.is_set():
        PAUSED.set()
        time.sleep(0.5)
    return nn.Sequential(nn.Flatten(), first, nn.ReLU(), nn.Linear(32, 10))


# For the test that a micro-batch's dropout draws are not disturbed by a model built in another thread:
# `pausing_dropout`'s forward (when `PAUSE_IN_FORWARD` is set) says so after the loop has seeded torch's
# generator, and waits, before its dropout, until `pausing_mlp`'s constructor pauses between two draws in
# another thread (for at most a second: with the lock held, that constructor cannot start).
PAUSE_IN_FORWARD = threading.Event()
FORWARD_PAUSED = threading.Event()


class _PausingDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(x.flatten(1)))
        if PAUSE_IN_FORWARD.is_set():
            FORWARD_PAUSED.set()
            PAUSED.wait(1.0)
        return self.out(nn.functional.dropout(h, 0.5, self.training))


def pausing_dropout() -> nn.Module:
    return _PausingDropout()


class _ClampsInPlace(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Changes a parameter in place (as some models clamp their weights): a compute worker holds no
        # parameters, so this is refused with a clear error.
        with torch.no_grad():
            self[1].weight.clamp_(-0.1, 0.1)
        return super().forward(x)


def clamps_in_place() -> nn.Module:
    return _ClampsInPlace(*_mlp_layers())
