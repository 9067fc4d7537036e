"""The step channel's messages (`wire/step_messages.py`): each comes back from its header (through the
frame's JSON, as it crosses the wire) as the message it was, and a header of no message is refused; each
answer too, read as the answer to what was sent, in the header both ends have always written."""

from __future__ import annotations

import json

import pytest
import torch

from prefect_elastic.errors import FatalError
from prefect_elastic.wire import (
    Applied,
    Apply,
    Confirm,
    Current,
    CurrentState,
    Entry,
    Failed,
    Next,
    ParamsBucket,
    Part,
    Pull,
    Push,
    ReplicaAsk,
    ReplicaSent,
    StepAnswer,
    StepMessage,
    Taken,
    Then,
    decode,
    decode_message,
    encode,
)
from prefect_elastic.wire.signals import BackupWanted, StaleGenerationError, StepPassed
from prefect_elastic.wire.step_messages import frames_after, is_quiet

MESSAGES: list[StepMessage] = [
    Pull(3, None),
    Pull(3, Then(None, 0.0, [7])),
    Pull(3, Then(4, 2.5, [16, 17], "tcp://a:1", copy=True)),
    Push(3, 4, "tcp://a:1", {16: 0.25, 17: 1.5}),
    Push(3, 4, "tcp://a:1", {16: 0.1}, Then(5, 2.5, [], "tcp://a:1", buckets=[[0, 8], [8, 10]]), ["w", "b"]),
    Push(3, 4, "tcp://a:1", {}, None, [], backup=True, bucketed=True),
    Part(3, 4, 16, 1, [[0, 8], [8, 10]]),
    Part(3, 4, 16, 0, [[0, 8], [8, 10]], backup=True),
    Apply(3, "tcp://a:1", 16, 2, 0.75),
    Apply(3, "tcp://a:1", 16, 2, 0.75, state=False),
    Current(3),
    ReplicaAsk(3, 1, 12),
    Confirm(3, 4, "tcp://a:1", [16, 17]),
]


@pytest.mark.parametrize("message", MESSAGES, ids=repr)
def test_a_message_is_the_same_message_after_the_wire(message: StepMessage) -> None:
    header = json.loads(json.dumps(message.header()))
    assert decode_message(header) == message


def test_a_frame_carries_a_message_and_its_tensors() -> None:
    tensors = [(Entry("grad", 16, "w"), torch.arange(4.0))]
    frame = Push(3, 4, "tcp://a:1", {16: 0.25}).frame(tensors)
    buffers = encode(frame)
    length = int.from_bytes(buffers[0][:4], "big")
    got = decode(bytes(buffers[0][4 : 4 + length]), bytearray(b"".join(bytes(b) for b in buffers[1:])))
    assert decode_message(got.header) == Push(3, 4, "tcp://a:1", {16: 0.25})
    assert [(e, t.tolist()) for e, t in got.tensors] == [(e, t.tolist()) for e, t in tensors]


def test_a_part_is_quiet() -> None:
    assert Part(3, 4, 16, 1, [[0, 8]]).frame().header["quiet"] is True
    assert is_quiet(Part(3, 4, 16, 1, [[0, 8]], backup=True).header())
    assert "backup" not in Part(3, 4, 16, 1, [[0, 8]]).header()  # (a member's own part: no key)
    assert not is_quiet(Push(3, 4, "tcp://a:1", {}).header()) and not is_quiet(Next().header())


@pytest.mark.parametrize("header", [{}, {"op": "ping", "generation": 1}, {"op": 3}])
def test_a_header_of_no_message_is_refused(header: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="no step message"):
        decode_message(header)


# Each answer, and its header as both ends have written it since before the answers were classes (the bits
# on the wire are the same: a loop of either side of the change reads a shard of the other).
ANSWERS: list[tuple[StepAnswer, dict[str, object]]] = [
    (Next(), {"ok": True}),
    (Next(0), {"ok": True, "shard": 0}),
    (Next(1, ["w", "b"]), {"ok": True, "shard": 1, "params": ["w", "b"]}),
    (
        Next(1, ["w", "b"], [["m"], ["n"]], 3, 40, "torch.float32"),
        {
            "ok": True,
            "shard": 1,
            "params": ["w", "b"],
            "buffers": [["m"], ["n"]],
            "follow": 3,
            "numel": 40,
            "dtype": "torch.float32",
        },
    ),
    (
        Next.failed(StepPassed(4, 5, 1)),
        {"ok": True, "next_error": {"error": "passed", "step": 4, "version": 5, "index": 1}},
    ),
    (
        Next.failed(BackupWanted(4, (16, 17))),
        {"ok": True, "next_error": {"error": "backup", "step": 4, "batch_ids": [16, 17]}},
    ),
    (ParamsBucket(1, 2), {"ok": True, "shard": 1, "bucket": 2}),
    (
        Applied("applied", 1, 0, 7),
        {"ok": True, "outcome": "applied", "staleness": 1, "shard": 0, "version": 7},
    ),
    (Applied("stale", 9, 1), {"ok": True, "outcome": "stale", "staleness": 9, "shard": 1}),
    (CurrentState(7, 1), {"ok": True, "version": 7, "shard": 1}),
    (
        Failed.because(StaleGenerationError(3, 4, "push")),
        {"error": "stale", "got": 3, "current": 4, "what": "push"},
    ),
    (Failed.because(FatalError("no"), unsent=2), {"error": "fatal", "message": "no", "unsent": 2}),
]


@pytest.mark.parametrize(("answer", "header"), ANSWERS, ids=repr)
def test_an_answer_is_the_same_answer_after_the_wire(answer: StepAnswer, header: dict[str, object]) -> None:
    assert answer.header() == header
    assert type(answer).of(json.loads(json.dumps(answer.header()))) == answer  # type: ignore[attr-defined]


def test_an_answer_that_says_nothing_more_is_a_bare_ok() -> None:
    assert Taken().header() == ReplicaSent().header() == {"ok": True}
    replica = [(Entry("replica", 0, ""), torch.arange(3.0))]
    assert ReplicaSent().frame(replica).unchanging and not Taken().frame().unchanging
    assert not Next(1).frame().unchanging


def test_an_answer_carries_its_tensors_and_what_follows_it() -> None:
    run = [(Entry("params", 0, ""), torch.arange(4.0))]
    following = iter([ParamsBucket(1, 0).frame(run)])
    frame = Next(1, ["w"], None, 1, 4, "torch.float32").frame(
        [(Entry("x", 16, ""), torch.ones(2))], following
    )
    assert frame.following is following and [e for e, _ in frame.tensors] == [Entry("x", 16, "")]
    buffers = encode(frame)
    length = int.from_bytes(buffers[0][:4], "big")
    got = decode(bytes(buffers[0][4 : 4 + length]), bytearray(b"".join(bytes(b) for b in buffers[1:])))
    assert Next.of(got.header) == Next(1, ["w"], None, 1, 4, "torch.float32")
    assert got.tensors[0][1].tolist() == [1.0, 1.0]


def test_an_answers_error_is_raised_as_the_shard_raised_it() -> None:
    passed = Next.of(json.loads(json.dumps(Next.failed(StepPassed(4, 5, 1)).header())))
    error = passed.failure()
    assert isinstance(error, StepPassed) and (error.step, error.version, error.index) == (4, 5, 1)
    with pytest.raises(StepPassed):
        passed.check()
    assert Next(1).failure() is None
    Next(1).check()  # (nothing to raise)
    wanted = Failed.of({"error": "backup", "step": 4, "batch_ids": [16]}).exception()
    assert isinstance(wanted, BackupWanted) and wanted.batch_ids == (16,)
    assert isinstance(Failed.of({"error": "what", "message": "x"}).exception(), RuntimeError)


def test_the_frames_after_an_answer_are_its_buckets_less_those_an_error_says_will_not_come() -> None:
    assert frames_after(Next(1, ["w"], None, 3, 4, "torch.float32").header()) == 3
    assert frames_after(Next(1).header()) == 0
    assert frames_after(ParamsBucket(1, 0).header()) == 0
    assert frames_after(Failed.because(FatalError("no"), unsent=2).header()) == -2
