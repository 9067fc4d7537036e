"""The wire: how compute loops and shards talk on the step path, outside Dask. A connection of its own per
loop and shard (`channel`: `ShardLink` on the loop's side, `ShardServer` on the shard's), frames of a JSON
header and raw tensor bytes (`codec`), bodies through shared memory between processes of one machine
(`inbox`), a sync shard's parameters published in shared memory for the loops on its machine
(`published`), and the memfd files both use (`memfd`).
"""

from .channel import ChannelAddress, ShardLink, ShardServer, unread_answers_dropped, worker_tls
from .codec import Entry, Frame, contiguous_strides, decode, encode, error_header, raise_error

__all__ = [
    "ChannelAddress",
    "Entry",
    "Frame",
    "ShardLink",
    "ShardServer",
    "contiguous_strides",
    "decode",
    "encode",
    "error_header",
    "raise_error",
    "unread_answers_dropped",
    "worker_tls",
]
