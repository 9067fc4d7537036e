"""The compute side of the overlapped step: gradient buckets handed to a sender during backward, and a
forward that waits for each module's own parameters only (docs/design/overlapped-step.md).

- `BucketHooks`: a hook on every parameter (a leaf of the step) that counts its bucket's gradients; the
  moment a bucket's last one is ready, the bucket (one flat run of its elements, in the shard's order, as
  the shard sums it: `bucket_plan.py`) goes to the `send` callback, in the order backward finishes them.
  Two ways to arm them: `accumulate` for a `loss.backward()` (post-accumulate-grad hooks: the gradient is
  the leaf's `.grad`), or not, for `torch.autograd.grad` as `MicroBatchTrainer.gradient` computes (tensor
  hooks on the leaves, which fire with the gradient autograd hands back). `finish` sends what backward
  never reached (parameters the micro-batch did not use: zeros, as `materialize_grads` gives).
- `ForwardGate`: forward pre-hooks on the modules that hold parameters, each asking `receive` for buckets
  until the ones holding its own parameters are in; `unguarded` says which parameters a model uses outside
  their own module's forward, where such a gate would not wait for them.

Nothing here sends or receives: `send` and `receive` are the loop's (`bucket_push.py`, `bucket_pull.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..data_server.bucket_plan import Bucket, bucket_of_tensor
from ..errors import FatalError
from ..sharding import part

Key = tuple[int, int]  # (shard, bucket index)
Send = Callable[[Bucket, torch.Tensor], None]


def key(bucket: Bucket) -> Key:
    return bucket.shard, bucket.index


class BucketHooks:
    """Hooks on `leaves` (the step's parameters by name) that hand each bucket of `plan` (every shard's
    buckets) to `send` once backward has all its gradients; armed again for the next micro-batch by
    `finish`. `sent`: the buckets in the order they went, since the last `finish`."""

    def __init__(
        self,
        plan: Sequence[Sequence[Bucket]],
        leaves: Mapping[str, torch.Tensor],
        send: Send,
        accumulate: bool = False,
    ) -> None:
        self._holding = bucket_of_tensor(plan)
        if set(self._holding) - set(leaves):
            raise FatalError(
                f"buckets of parameters {sorted(set(self._holding) - set(leaves))} not in the step"
            )
        self._buckets = [b for buckets in plan for b in buckets]
        self._leaves = dict(leaves)
        self._send = send
        self._grads: dict[str, torch.Tensor] = {}
        self._missing: dict[Key, int] = {}
        self.sent: list[Bucket] = []
        self._handles: list[RemovableHandle] = []
        for name, leaf in self._leaves.items():
            if name not in self._holding:
                continue
            if accumulate:
                self._handles.append(leaf.register_post_accumulate_grad_hook(self._accumulated(name)))
            else:
                self._handles.append(leaf.register_hook(self._captured(name)))
        self._arm()

    def _arm(self) -> None:
        self._grads = {}
        self._missing = {key(b): len(b.pieces) for b in self._buckets}
        self.sent = []

    def _accumulated(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(leaf: torch.Tensor) -> None:
            assert leaf.grad is not None  # (the hook runs right after autograd wrote it)
            self._ready(name, leaf.grad)

        return hook

    def _captured(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._ready(name, grad)  # (returns None: the gradient goes on unchanged)

        return hook

    def _ready(self, name: str, grad: torch.Tensor) -> None:
        if name in self._grads:
            # A second gradient of one leaf in one backward: only a graph that reaches it twice through
            # separate AccumulateGrad calls (a reentrant checkpoint) does this; its bucket left already.
            raise FatalError(f"the gradient of {name} came twice in one backward")
        self._grads[name] = grad
        for bucket, _ in self._holding[name]:
            k = key(bucket)
            self._missing[k] -= 1
            if self._missing[k] == 0:
                self._hand_over(bucket)

    def _hand_over(self, bucket: Bucket) -> None:
        # Several tensors: one new flat run in the shard's order (the copy DDP makes into its bucket too).
        # One contiguous gradient (the 9.4 MB convolutions of a ResNet's last stage): a flat view of it, no
        # copy, as a big gradient goes today (`gradient_entries`); autograd hands it back and never writes
        # it again, and a loop that backwards into `.grad` clears it before the next micro-batch.
        runs = []
        for p in bucket.pieces:
            grad = self._grads.get(p.name)
            if grad is None:
                leaf = self._leaves[p.name]
                grad = torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
            runs.append(part(grad.detach(), p).reshape(-1))
        self.sent.append(bucket)
        self._send(bucket, runs[0] if len(runs) == 1 else torch.cat(runs))

    def finish(self) -> list[Bucket]:
        """Backward ended: send the buckets it did not complete (their missing gradients zeros), in the
        plan's order, then arm the hooks for the next micro-batch. Returns every bucket sent, in order."""
        for bucket in self._buckets:
            if self._missing[key(bucket)] > 0:
                self._missing[key(bucket)] = 0
                self._hand_over(bucket)
        sent = self.sent
        self._arm()
        return sent

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def module_needs(
    model: nn.Module, plan: Sequence[Sequence[Bucket]], aliases: Mapping[str, str] | None = None
) -> dict[str, set[Key]]:
    """Each module (by name) that holds parameters of its own, with the buckets that hold them. `aliases`:
    a tied parameter's other names, each with the name the plan knows it by."""
    holding = bucket_of_tensor(plan)
    aliases = aliases or {}
    needs: dict[str, set[Key]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        keys: set[Key] = set()
        for own, _ in module.named_parameters(recurse=False, remove_duplicate=False):
            name = f"{module_name}.{own}" if module_name else own
            keys |= {key(b) for b, _ in holding.get(aliases.get(name, name), [])}
        if keys:
            needs[module_name] = keys
    return needs


class ForwardGate:
    """Forward pre-hooks on `model`'s modules that hold parameters: each calls `receive(k)` (which takes
    the next bucket from the shard of bucket `k` off the wire, in the order that shard sends them, and
    puts its bytes where the step's parameters are) until the buckets of its own parameters are in.
    `arrived`: what came, in order; `waited`: the modules whose hook had to receive something, in the
    order forward ran them."""

    def __init__(
        self,
        model: nn.Module,
        plan: Sequence[Sequence[Bucket]],
        receive: Callable[[Key], Bucket],
        aliases: Mapping[str, str] | None = None,
        done: Callable[[], None] | None = None,
        reads: Mapping[str, str] | None = None,
    ) -> None:
        """`done`: called when the model's forward ends (a forward hook on `model` itself). `reads`: the
        parameters a module reads before their own module runs (`unguarded`), each with that module's
        name: its pre-hook waits for their buckets too."""
        self._receive = receive
        self.arrived: list[Bucket] = []
        self._in: set[Key] = set()
        self.waited: list[str] = []
        needs = module_needs(model, plan, aliases)
        holding = bucket_of_tensor(plan)
        for name, reader in (reads or {}).items():
            needs.setdefault(reader, set()).update(key(b) for b, _ in holding.get(name, []))
        self._handles = [
            model.get_submodule(name).register_forward_pre_hook(self._hook(name, keys))
            for name, keys in needs.items()
        ]
        if done is not None:
            self._handles.append(model.register_forward_hook(lambda *_: done()))

    def _hook(self, name: str, keys: set[Key]) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.wait(keys, name)

        return hook

    def wait(self, keys: set[Key], who: str = "") -> None:
        """Receive until every bucket of `keys` is in."""
        if keys <= self._in:
            return
        self.waited.append(who)
        for wanted in sorted(keys - self._in):
            while wanted not in self._in:
                bucket = self._receive(wanted)
                self.arrived.append(bucket)
                self._in.add(key(bucket))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _FirstUses(TorchFunctionMode):
    """Records, for each tensor of `watched` (by id), the module running (`running`) when an op first used
    it before `ready` said so."""

    def __init__(
        self, watched: Mapping[int, str], ready: Callable[[str], bool], running: Callable[[], str]
    ) -> None:
        super().__init__()
        self._watched = watched
        self._ready = ready
        self._running = running
        self.early: dict[str, str] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        for value in [*args, *(kwargs or {}).values()]:
            for t in value if isinstance(value, list | tuple) else (value,):
                name = self._watched.get(id(t)) if isinstance(t, torch.Tensor) else None
                if name is not None and name not in self.early and not self._ready(name):
                    self.early[name] = self._running()
        return func(*args, **(kwargs or {}))


def unguarded(
    model: nn.Module,
    plan: Sequence[Sequence[Bucket]],
    run: Callable[[Mapping[str, torch.Tensor]], Any],
    params: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The parameters a forward uses before a `ForwardGate` would have received them, each with the
    module whose forward was running at that first use (the innermost): used outside their own module's
    forward (a weight tied in code, a parameter a parent reads, as `nn.MultiheadAttention` reads its
    `out_proj.weight`). A gate given them (`reads`) waits for their buckets in that module's pre-hook.
    `run(params)` runs the forward (on the meta model, with meta `params`, it costs no compute)."""
    holding = bucket_of_tensor(plan)
    received: set[Key] = set()
    stack: list[str] = []

    def entered(name: str, keys: set[Key]) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            stack.append(name)
            received.update(keys)

        return hook

    def left(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()

    needs = module_needs(model, plan, aliases)
    handles: list[RemovableHandle] = []
    for name, module in model.named_modules():  # (each module once: the name forward knows it by first)
        handles.append(module.register_forward_pre_hook(entered(name, needs.get(name, set()))))
        handles.append(module.register_forward_hook(left))
    names = {id(t): n for n, t in params.items() if n in holding}
    try:
        ready = lambda name: all(key(b) in received for b, _ in holding[name])  # noqa: E731
        with _FirstUses(names, ready, lambda: stack[-1] if stack else "") as uses:
            run(params)
    finally:
        for handle in handles:
            handle.remove()
    return uses.early
