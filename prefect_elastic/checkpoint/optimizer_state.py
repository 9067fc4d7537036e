"""The optimizer's state by the model's tensor names, whole, as a checkpoint holds it, and each shard's part
of it in torch's form (pure).

A shard's optimizer gives torch's `state_dict` over its own parameters (`ShardOptimizer.state_dict`: state
entries by position in the shard's order, the parts of a split tensor as flat runs). A checkpoint holds
`by_name`: `{"state": {name: {key: value}}, "param_groups": [the group's settings]}`, each entry of the
whole tensor. So a checkpoint reads the same whichever plan wrote it, and resumes under another plan (more
or fewer data servers holding parameters, split or whole). Only elementwise optimizers are used
(`job.splits_tensors`): an entry of one element per parameter element is cut and joined by range, any other
(Adam's step count) is the same on every part and is taken from the first.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from ..sharding import Piece


def join_optimizer(
    states: Sequence[dict[str, Any]], plan: Sequence[Sequence[Piece]], shapes: dict[str, torch.Size]
) -> dict[str, Any]:
    """The whole optimizer state by name, out of each shard's (`states[i]` over the pieces of `plan[i]`
    that are parameters, in order: those whose name `shapes` has)."""
    groups: list[dict[str, Any]] = []
    parts: dict[str, dict[str, list[tuple[Piece, Any]]]] = {}
    for state, pieces in zip(states, plan, strict=True):
        held = [p for p in pieces if p.name in shapes]
        if not held or not state or not state.get("param_groups"):
            continue  # (no parameters there; or no settings: a checkpoint made by hand)
        if not groups:
            (group,) = state["param_groups"]
            groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}]
        positions = state["param_groups"][0]["params"]
        for piece, position in zip(held, positions, strict=True):
            for key, value in state["state"].get(position, {}).items():
                parts.setdefault(piece.name, {}).setdefault(key, []).append((piece, value))
    joined: dict[str, dict[str, Any]] = {}
    for name in shapes:
        for key, runs in parts.get(name, {}).items():
            first = runs[0][1]
            if not isinstance(first, torch.Tensor) or first.dim() == 0:
                value = copy.deepcopy(first)
            elif len(runs) == 1 and runs[0][0].whole:
                value = first.detach().clone()
            else:
                flat = torch.empty(runs[0][0].size, dtype=first.dtype, device=first.device)
                for piece, run in runs:
                    flat[piece.start : piece.stop] = run.detach().reshape(-1)
                value = flat.view(shapes[name])
            joined.setdefault(name, {})[key] = value
    return {"state": joined, "param_groups": groups}


def cut_optimizer(whole: dict[str, Any], pieces: Sequence[Piece]) -> dict[str, Any] | None:
    """Torch's `state_dict` for a shard's optimizer over `pieces` (its parameters, in order), out of the
    whole state by name; None where the shard holds no parameter or the state has no settings."""
    if not pieces or not whole.get("param_groups"):
        return None
    state: dict[int, dict[str, Any]] = {}
    for position, piece in enumerate(pieces):
        entry: dict[str, Any] = {}
        for key, value in whole["state"].get(piece.name, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and not piece.whole:
                entry[key] = value.reshape(-1)[piece.start : piece.stop]
            else:
                entry[key] = value
        if entry:
            state[position] = entry
    (group,) = whole["param_groups"]
    return {"state": state, "param_groups": [{**group, "params": list(range(len(pieces)))}]}
