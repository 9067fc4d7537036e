"""A shard's second copy of its parameters and optimizer state, into which the overlapped step applies each
bucket as soon as it is whole (`overlap_push`; docs/design/overlapped-step.md, "Two copies").

Why: with gradients leaving during backward, what was left of a big model's step after backward was
mostly the shard's update, run after the last seal: 13 to 15 ms for the ResNet-18's 45 MB. Applied bucket
by bucket while the loops' backward still runs, it hides. But the loops read the published parameters in
place (`wire/published.py`), and a step may still be dropped (a fence) until every micro-batch of it is
sealed, so the update cannot be made in place: it is written from the published copy into this one
(`bucket_apply.sgd_into`, `adam_into`: torch's own operations with `out=`, so the same bits), and the
commit publishes it (`flip`). A dropped step leaves the published copy as it was; nothing is undone.

Who may read what (the argument of step-channel.md, "Why a loop may read memory the shard writes"):
the open step's applies write only the copy that holds the version before the published one, which no
loop of the generation reads any more (each sealed its share of that step, and the step committed), except
a straggler still computing it, whose pushes are refused (`StepPassed`). A snapshot reads the published
copy; the commit (which makes it the copy the next step writes) waits for it to end.

The copy lies in a published region of its own, so loops on this machine read whichever copy is published
in place; it is made on the first bucket a shard applies, so jobs that never send parts pay no memory
for it: one more copy of the shard's parameters and of its optimizer's state per element (SGD's momentum,
Adam's two averages).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..wire.published import empty_flat
from .bucket_apply import AdamState, adam_into, sgd_into
from .optimizer import ShardOptimizer

Kind = Literal["sgd", "adam"]


def copy_kind(optimizer: ShardOptimizer) -> Kind | None:
    """Which out-of-place update the shard's optimizer has (None: none; the step is applied whole at the
    commit, as without parts): torch's SGD, Adam or AdamW over the one flat tensor, one parameter group,
    on the single-tensor path `bucket_apply` writes out (not fused, foreach, capturable or
    differentiable), with numbers, not tensors, for hyperparameters."""
    torch_optimizer = optimizer.torch_optimizer
    if optimizer.flat is None or len(torch_optimizer.param_groups) != 1:
        return None
    group = torch_optimizer.param_groups[0]
    if group.get("fused") or group.get("foreach") or group.get("differentiable"):
        return None
    if any(isinstance(v, torch.Tensor) for k, v in group.items() if k != "params"):
        return None
    if type(torch_optimizer) is torch.optim.SGD:
        return "sgd"
    if type(torch_optimizer) in (torch.optim.Adam, torch.optim.AdamW) and not group.get("capturable"):
        return "adam"
    return None


class OtherCopy:
    """The copy of `optimizer`'s flat parameters (and their state) that loops do not read: the open step's
    buckets are written into it, and `flip` publishes it."""

    def __init__(self, optimizer: ShardOptimizer, kind: Kind) -> None:
        flat = optimizer.flat
        assert flat is not None  # (`copy_kind` says None otherwise)
        self.optimizer = optimizer
        self.kind = kind
        self._flat, self._region = empty_flat(flat.numel(), flat.dtype)
        self._state: dict[str, Any] = {}  # the other copy's optimizer state, made as an apply needs it
        self.applied = 0  # buckets applied into it (counted for the shard's phases)

    def _published(self) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
        optimizer = self.optimizer.torch_optimizer
        flat = self.optimizer.flat
        assert flat is not None
        return flat, optimizer.state.get(flat, {}), optimizer.param_groups[0]

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self._state.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = self._state[key] = torch.empty_like(like)
        return buffer

    def apply(self, start: int, stop: int, gradient: torch.Tensor) -> None:
        """The open step's update of elements `[start, stop)` with their `gradient` (the step's mean), from
        the published copy into this one; the published copy and its state are not written."""
        flat, state, group = self._published()
        source, target = flat[start:stop], self._flat[start:stop]
        if self.kind == "sgd":
            momentum = group["momentum"]
            published = state.get("momentum_buffer")
            sgd_into(
                source,
                published[start:stop] if published is not None else None,
                gradient,
                target,
                self._buffer("momentum_buffer", flat)[start:stop] if momentum != 0 else None,
                lr=group["lr"],
                momentum_factor=momentum,
                dampening=group["dampening"],
                weight_decay=group["weight_decay"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
            )
        else:
            amsgrad = group["amsgrad"]
            keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
            # (torch starts them as zeros at the first step; a view of zeros reads the same.)
            zeros = torch.zeros_like(source) if not state else None
            ours = [self._buffer(k, flat)[start:stop] for k in keys]
            theirs = [state[k][start:stop] if zeros is None else zeros for k in keys]
            beta1, beta2 = group["betas"]
            adam_into(
                source,
                AdamState(*theirs),
                gradient,
                target,
                AdamState(*ours),
                step=self._step_number(state),
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False))
                or type(self.optimizer.torch_optimizer) is torch.optim.AdamW,
                amsgrad=amsgrad,
                maximize=group["maximize"],
            )
        self.applied += 1

    @staticmethod
    def _step_number(published: dict[str, Any]) -> int:
        """Adam's number of the step being applied: one more than the published copy's count."""
        step = published.get("step")
        return int(step.item() if isinstance(step, torch.Tensor) else step or 0) + 1

    def flip(self) -> None:
        """The step commits: every bucket of it was applied here, so this copy is published, and the one
        the loops read until now becomes the copy the next step writes into."""
        _, state, group = self._published()
        ours = dict(self._state)
        if self.kind == "adam":
            # (torch keeps the count as a float32 tensor of its own per parameter, and adds 1 in place.)
            ours["step"] = torch.tensor(float(self._step_number(state)), dtype=torch.float32)
        elif group["momentum"] == 0:
            ours = {}
        self._swap(ours)

    def flip_back(self) -> None:
        """Undo the last `flip`: the copy published before it is published again, with its state. Only
        while no bucket was applied since (it would have written into that copy: `ShardState.kept`)."""
        _, state, group = self._published()
        ours = dict(self._state)
        if self.kind == "adam":
            before = self._step_number(state) - 2  # (the published count, less the step undone)
            ours = {**ours, "step": torch.tensor(float(before), dtype=torch.float32)} if before > 0 else {}
        elif group["momentum"] == 0:
            ours = {}
        self._swap(ours)

    def _swap(self, ours: dict[str, Any]) -> None:
        """Publish this copy with `ours` for its optimizer state; the copy published until now becomes
        this one, with its state."""
        old_flat, old_region, old_state = self.optimizer.publish(self._flat, self._region, ours)
        # (The region keeps its memory's descriptor open for the loops that map it: kept with the copy.)
        self._flat, self._region = old_flat, old_region
        self._state = {k: v for k, v in old_state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
