"""A bucket's optimizer update written into the shard's other copy (docs/design/overlapped-step.md).

The overlapped step applies a bucket as soon as it is whole, before the step commits, so it must leave
the published parameters and the optimizer state as they were (`bucket_book.TwoCopies`). Copying the
bucket into the other copy and updating it there costs a second pass over the bytes: measured on the
ResNet-18 (`python -m benchmarks.overlap`), 2-4 times the update itself. `sgd_into` reads the published
copy and writes the other in the same passes as torch's own update, each in-place operation of torch's
single-tensor SGD (`torch.optim.sgd._single_tensor_sgd`) made with `out=` into the target: the same
kernels on the same values, so the same bits (`tests/unit/test_bucket_apply.py`). `adam_into` does the
same for Adam and AdamW (torch's `_single_tensor_adam`, the path `Adam.step` takes on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sgd_into(
    source: torch.Tensor,
    momentum: torch.Tensor | None,
    gradient: torch.Tensor,
    target: torch.Tensor,
    target_momentum: torch.Tensor | None,
    *,
    lr: float,
    momentum_factor: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> None:
    """One SGD step of a bucket: from the parameters `source` and their momentum buffer `momentum` (None
    before the first step) into `target` and `target_momentum`, with `gradient`; `source` and `momentum`
    are not written. The arguments are `SGD`'s (`momentum_factor` is its `momentum`)."""
    with torch.no_grad():
        grad = gradient if not maximize else -gradient
        if weight_decay != 0:
            grad = grad.add(source, alpha=weight_decay)
        if momentum_factor != 0:
            if target_momentum is None:
                raise ValueError("SGD with momentum needs the other copy's momentum buffer")
            if momentum is None:
                target_momentum.copy_(grad)
            else:
                torch.mul(momentum, momentum_factor, out=target_momentum)
                target_momentum.add_(grad, alpha=1 - dampening)
            grad = grad.add(target_momentum, alpha=momentum_factor) if nesterov else target_momentum
        torch.add(source, grad, alpha=-lr, out=target)


@dataclass(frozen=True)
class AdamState:
    """One copy of a bucket's Adam state: the moving averages (and their running maximum, for amsgrad)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None = None


def adam_into(
    source: torch.Tensor,
    state: AdamState,
    gradient: torch.Tensor,
    target: torch.Tensor,
    target_state: AdamState,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
    amsgrad: bool = False,
    maximize: bool = False,
) -> None:
    """Adam's (AdamW's, with `decoupled_weight_decay`) step number `step` (1 for the first) of a bucket:
    from `source` and `state` (zeros before the first step, as torch starts them) into `target` and
    `target_state`; `source` and `state` are not written."""
    with torch.no_grad():
        grad = gradient if not maximize else -gradient
        base = source
        if weight_decay != 0:
            if decoupled_weight_decay:
                torch.mul(source, 1 - lr * weight_decay, out=target)
                base = target
            else:
                grad = grad.add(source, alpha=weight_decay)
        torch.lerp(state.exp_avg, grad, 1 - beta1, out=target_state.exp_avg)
        torch.mul(state.exp_avg_sq, beta2, out=target_state.exp_avg_sq)
        target_state.exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
        # (torch reads the step count from a float tensor: the same float here.)
        count = float(step)
        step_size = lr / (1 - beta1**count)
        bias_correction2_sqrt = (1 - beta2**count) ** 0.5
        second = target_state.exp_avg_sq
        if amsgrad:
            if state.max_exp_avg_sq is None or target_state.max_exp_avg_sq is None:
                raise ValueError("amsgrad needs both copies' running maximum")
            torch.maximum(state.max_exp_avg_sq, second, out=target_state.max_exp_avg_sq)
            second = target_state.max_exp_avg_sq
        denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
        torch.addcdiv(base, target_state.exp_avg, denom, value=-step_size, out=target)
