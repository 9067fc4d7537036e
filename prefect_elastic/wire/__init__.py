"""The wire: how compute loops and shards talk on the step path, outside Dask. A connection of its own per
loop and shard (`channel`: `ShardLink` on the loop's side, `ShardServer` on the shard's), frames of a JSON
header and raw tensor bytes (`codec`), bodies through shared memory between processes of one machine
(`inbox`), a sync shard's parameters published in shared memory for the loops on its machine
(`published`), and the memfd files both use (`memfd`); the messages a loop sends a shard, each a class
(`step_messages`: `Pull`, `Push`, `Part`, `Apply`, `Current`, `ReplicaAsk`, `Confirm`) and what a shard
answers, each a class too (`Next`, `ParamsBucket`, `Taken`, `Applied`, `CurrentState`, `ReplicaSent`,
`Failed`).
"""

from .channel import ChannelAddress, ShardLink, ShardServer, unread_answers_dropped, worker_tls
from .codec import Entry, Frame, contiguous_strides, decode, encode, error_header, raise_error
from .step_messages import (
    Applied,
    Apply,
    Ask,
    Confirm,
    Current,
    CurrentState,
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
    decode_message,
)

__all__ = [
    "Applied",
    "Apply",
    "Ask",
    "ChannelAddress",
    "Confirm",
    "Current",
    "CurrentState",
    "Entry",
    "Failed",
    "Frame",
    "Next",
    "ParamsBucket",
    "Part",
    "Pull",
    "Push",
    "ReplicaAsk",
    "ReplicaSent",
    "ShardLink",
    "ShardServer",
    "StepAnswer",
    "StepMessage",
    "Taken",
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
