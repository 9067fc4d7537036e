"""The wire: how compute loops and shards talk on the step path, outside Dask. A connection of its own per
loop and shard (`channel`: `ShardLink` on the loop's side, `ShardServer` on the shard's), frames of a JSON
header and raw tensor bytes (`codec`), bodies through shared memory between processes of one machine
(`inbox`), a sync shard's parameters published in shared memory for the loops on its machine
(`published`), and the memfd files both use (`memfd`); the messages a loop sends a shard, each a class
(`step_messages`: `Pull`, `Push`, `Part`, `Apply`, `Current`, `ReplicaAsk`, `Confirm`).
"""

from .channel import ChannelAddress, ShardLink, ShardServer, unread_answers_dropped, worker_tls
from .codec import Entry, Frame, contiguous_strides, decode, encode, error_header, raise_error
from .step_messages import (
    Apply,
    Confirm,
    Current,
    Part,
    Pull,
    Push,
    ReplicaAsk,
    StepMessage,
    Then,
    decode_message,
)

__all__ = [
    "Apply",
    "ChannelAddress",
    "Confirm",
    "Current",
    "Entry",
    "Frame",
    "Part",
    "Pull",
    "Push",
    "ReplicaAsk",
    "ShardLink",
    "ShardServer",
    "StepMessage",
    "Then",
    "contiguous_strides",
    "decode",
    "decode_message",
    "encode",
    "error_header",
    "raise_error",
    "unread_answers_dropped",
    "worker_tls",
]
