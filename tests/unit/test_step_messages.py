"""The step channel's messages (`wire/step_messages.py`): each comes back from its header (through the
frame's JSON, as it crosses the wire) as the message it was, and a header of no message is refused."""

from __future__ import annotations

import json

import pytest
import torch

from prefect_elastic.wire import (
    Apply,
    Current,
    Entry,
    Part,
    Pull,
    Push,
    ReplicaAsk,
    StepMessage,
    Then,
    decode,
    decode_message,
    encode,
)

MESSAGES: list[StepMessage] = [
    Pull(3, None),
    Pull(3, Then(None, 0.0, [7])),
    Pull(3, Then(4, 2.5, [16, 17], "tcp://a:1", copy=True)),
    Push(3, 4, "tcp://a:1", {16: 0.25, 17: 1.5}),
    Push(3, 4, "tcp://a:1", {16: 0.1}, Then(5, 2.5, [], "tcp://a:1", buckets=[[0, 8], [8, 10]]), ["w", "b"]),
    Push(3, 4, "tcp://a:1", {}, None, [], backup=True, bucketed=True),
    Part(3, 4, 16, 1, [[0, 8], [8, 10]]),
    Apply(3, "tcp://a:1", 16, 2, 0.75),
    Apply(3, "tcp://a:1", 16, 2, 0.75, state=False),
    Current(3),
    ReplicaAsk(3, 1, 12),
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


@pytest.mark.parametrize("header", [{}, {"op": "ping", "generation": 1}, {"op": 3}])
def test_a_header_of_no_message_is_refused(header: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="no step message"):
        decode_message(header)
