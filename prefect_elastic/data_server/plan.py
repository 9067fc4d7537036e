"""The sharding plan: which of the model's tensors each data server holds.

Pure: the controller computes it once when a job starts (and again from a checkpoint), every process the
same way; nothing here touches a cluster.
"""

from __future__ import annotations

import torch


def plan_shards(state: dict[str, torch.Tensor], shards: int, min_bytes: int = 0) -> list[list[str]]:
    """Deal whole tensors to shards, largest first onto the lightest shard (deterministic).

    Whole tensors keep each optimizer state entry on one shard; elementwise optimizers then give the
    same numbers as on the whole model. Ties break on the name so every process computes the same plan.

    Only as many shards as can each hold `min_bytes` of `state` get tensors (at least one; 0: every
    shard): each one that does is on the critical path of every step (`ElasticJob.min_shard_bytes`).
    They are the last ones: the controller places the coordinator beside data server 0, whose process
    then answers the coordinator's calls too.
    """
    total = sum(t.numel() * t.element_size() for t in state.values())
    holders = shards if min_bytes <= 0 else max(1, min(shards, total // min_bytes))
    loads = [0] * shards
    plan: list[list[str]] = [[] for _ in range(shards)]
    for name in sorted(state, key=lambda n: (-state[n].numel(), n)):
        target = min(range(shards - holders, shards), key=lambda i: (loads[i], i))
        plan[target].append(name)
        loads[target] += state[name].numel()
    order = {name: i for i, name in enumerate(state)}
    return [sorted(names, key=order.__getitem__) for names in plan]
