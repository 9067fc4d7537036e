"""The sharding plan: which of the model's tensors, or which element ranges of them, each data server holds.

Pure: the controller computes it once when a job starts (and again from a checkpoint), every process the
same way; nothing here touches a cluster.

Two plans: `plan_shards` deals whole tensors (one 1.6 MB layer then lives on one shard alone, and that
shard carries more than its share of the bytes and of the optimizer's work); `plan_pieces` with `split`
cuts the model, read as one flat run of elements in its own order, into contiguous ranges of about equal
size, so a tensor larger than its share lies on several shards as `Piece`s. Splitting is only correct for
an optimizer whose update is elementwise (`job.splits_tensors` decides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import FatalError

# A cut that falls inside a tensor smaller than this moves to the tensor's nearer edge: splitting a small
# tensor costs one more entry in every frame and saves next to nothing (a shard's load then differs from
# the even share by half of this at most on each side).
SPLIT_MIN_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class Piece:
    """The elements `[start, stop)` of tensor `name` (its flat, row-major order), of `size` in all."""

    name: str
    start: int
    stop: int
    size: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.size

    @property
    def numel(self) -> int:
        return self.stop - self.start


def holders(state: dict[str, torch.Tensor], shards: int, min_bytes: int) -> int:
    """How many shards get tensors: as many as can each hold `min_bytes` of `state` (at least one; 0:
    every shard). They are the last ones: the controller places the coordinator beside data server 0,
    whose process then answers the coordinator's calls too."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    return shards if min_bytes <= 0 else max(1, min(shards, total // min_bytes))


def plan_shards(state: dict[str, torch.Tensor], shards: int, min_bytes: int = 0) -> list[list[str]]:
    """Deal whole tensors to shards, largest first onto the lightest shard (deterministic).

    Whole tensors keep each optimizer state entry on one shard; elementwise optimizers then give the
    same numbers as on the whole model. Ties break on the name so every process computes the same plan.

    Only as many shards as can each hold `min_bytes` of `state` get tensors (`holders`): each one that does
    is on the critical path of every step (`ElasticJob.min_shard_bytes`).
    """
    count = holders(state, shards, min_bytes)
    loads = [0] * shards
    plan: list[list[str]] = [[] for _ in range(shards)]
    for name in sorted(state, key=lambda n: (-state[n].numel(), n)):
        target = min(range(shards - count, shards), key=lambda i: (loads[i], i))
        plan[target].append(name)
        loads[target] += state[name].numel()
    order = {name: i for i, name in enumerate(state)}
    return [sorted(names, key=order.__getitem__) for names in plan]


def plan_pieces(
    state: dict[str, torch.Tensor], shards: int, min_bytes: int = 0, split: bool = True
) -> list[list[Piece]]:
    """Each shard's pieces, in the model's order. Without `split`, `plan_shards`' whole tensors.

    With `split`: the model's elements, tensor after tensor in `state`'s order, cut into `holders` runs of
    about equal length (`SPLIT_MIN_ELEMENTS`: a small tensor is never cut), the last shards holding them.
    Each shard then holds at most one contiguous range of a tensor, and every element lies on exactly one
    shard. Where that leaves the fullest shard no lighter than whole tensors do (a model of many small
    tensors, whose runs cannot be evened out without cuts), the whole tensors. Depends on the names, order
    and sizes of `state` only."""
    whole = [
        [Piece(n, 0, state[n].numel(), state[n].numel()) for n in names]
        for names in plan_shards(state, shards, min_bytes)
    ]
    if not split:
        return whole
    cut_up = _runs(state, shards, min_bytes)
    return cut_up if _fullest(cut_up) < _fullest(whole) else whole


def _fullest(plan: list[list[Piece]]) -> int:
    return max((sum(p.numel for p in pieces) for pieces in plan), default=0)


def _runs(state: dict[str, torch.Tensor], shards: int, min_bytes: int) -> list[list[Piece]]:
    """The model's elements cut into `holders` contiguous runs, the last shards holding them."""
    count = holders(state, shards, min_bytes)
    sizes = [(name, t.numel()) for name, t in state.items()]
    total = sum(size for _, size in sizes)
    cuts = [_snap(total * k // count, sizes) for k in range(count + 1)]
    plan: list[list[Piece]] = [[] for _ in range(shards)]
    offset = 0
    for name, size in sizes:
        for k in range(count):
            low, high = max(offset, cuts[k]), min(offset + size, cuts[k + 1])
            # (A tensor of no elements goes to the shard whose run holds its place, the last at the end.)
            empty_here = size == 0 and (
                cuts[k] <= offset < cuts[k + 1] or (k == count - 1 and offset == total)
            )
            if low < high or empty_here:
                plan[shards - count + k].append(Piece(name, low - offset, high - offset, size))
        offset += size
    # The shards a tiny model left empty come first, as those beyond `holders` do.
    return [pieces for pieces in plan if not pieces] + [pieces for pieces in plan if pieces]


def _snap(cut: int, sizes: list[tuple[str, int]]) -> int:
    """`cut` moved to the nearer edge (the start on a tie) of the tensor it falls inside, where that tensor
    is smaller than `SPLIT_MIN_ELEMENTS`. Monotone in `cut`, so the runs stay in order."""
    offset = 0
    for _, size in sizes:
        if offset < cut < offset + size:
            if size >= SPLIT_MIN_ELEMENTS:
                return cut
            return offset if cut - offset <= offset + size - cut else offset + size
        offset += size
    return cut


def piece_names(plan: list[list[Piece]]) -> list[list[str]]:
    """The names of the tensors each shard holds (all or part of)."""
    return [[p.name for p in pieces] for pieces in plan]


def pieces_of(held: Sequence[Piece | str], sizes: dict[str, int]) -> list[Piece]:
    """`held` as pieces: a name stands for the whole tensor (of `sizes[name]` elements), as a plan of
    whole tensors (`plan_shards`) names them."""
    return [h if isinstance(h, Piece) else Piece(h, 0, sizes[h], sizes[h]) for h in held]


def part(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """`piece` of the whole `tensor`: itself where whole, else a flat run of its elements (a view of a
    contiguous tensor)."""
    return tensor if piece.whole else tensor.reshape(-1)[piece.start : piece.stop]


def cut(state: dict[str, torch.Tensor], pieces: Sequence[Piece]) -> dict[str, torch.Tensor]:
    """A shard's tensors out of whole ones, by name (`part` of each)."""
    return {p.name: part(state[p.name], p) for p in pieces}


def split_pieces(plan: Sequence[Sequence[Piece]], shard: int | None) -> dict[str, Piece]:
    """The pieces of shard `shard` that are parts of a tensor split across shards, by name (none where
    `shard` is None or past the plan)."""
    if shard is None or not 0 <= shard < len(plan):
        return {}
    return {p.name: p for p in plan[shard] if not p.whole}


def joined(runs: Sequence[tuple[Piece, torch.Tensor]], shape: torch.Size) -> torch.Tensor:
    """A new whole tensor of `shape` out of the parts of it in `runs` (every element once; FatalError
    where they do not cover it)."""
    first = runs[0][1]
    if sum(p.numel for p, _ in runs) != runs[0][0].size:
        raise FatalError(
            f"parts of {runs[0][0].name} came for {sum(p.numel for p, _ in runs)} of its elements"
        )
    flat = torch.empty(runs[0][0].size, dtype=first.dtype, device=first.device)
    for p, run in runs:
        flat[p.start : p.stop] = run.reshape(-1)
    return flat.view(shape)


def join(
    parts: Sequence[dict[str, torch.Tensor]], plan: Sequence[Sequence[Piece]], shapes: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """Whole tensors out of every shard's tensors (`parts[i]` holds shard `i`'s pieces by name, as `cut`
    gives them), in the order of `shapes`; a whole piece is taken as it is, the parts of a split tensor are
    copied into a new one."""
    whole: dict[str, torch.Tensor] = {}
    split: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for held, pieces in zip(parts, plan, strict=True):
        for p in pieces:
            if p.whole:
                whole[p.name] = held[p.name]
            else:
                split.setdefault(p.name, []).append((p, held[p.name]))
    for name, runs in split.items():
        whole[name] = joined(runs, shapes[name])
    return {name: whole[name] for name in shapes if name in whole}
