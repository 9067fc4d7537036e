"""A bucket's optimizer update written into the shard's other copy (docs/design/overlapped-step.md).

The overlapped step applies a bucket as soon as it is whole, before the step commits, so it must leave
the published parameters and the optimizer state as they were (`bucket_book.TwoCopies`). Copying the
bucket into the other copy and updating it there costs a second pass over the bytes: measured on the
ResNet-18 (`python -m benchmarks.overlap`), 2-4 times the update itself. `sgd_into` reads the published
copy and writes the other in the same passes as torch's own update, each in-place operation of torch's
single-tensor SGD (`torch.optim.sgd._single_tensor_sgd`) made with `out=` into the target: the same
kernels on the same values, so the same bits (`tests/unit/test_bucket_apply.py`). Other optimizers copy
and update in place until they have one.
"""

from __future__ import annotations

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
