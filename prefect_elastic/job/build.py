"""What every role builds from a job the same way: the model, the loss, the optimizer, the state's layout.

The built-in losses and optimizers are named here (`OPTIMIZERS`, `LOSSES`: the optimizers work elementwise,
so a parameter shard gets the same numbers as the whole model); anything else is an import path
'module:callable' (`resolve_callable`, whose errors name the job's field). `GLOBAL_RNG_LOCK` is held by
whatever seeds torch's one global generator and draws from it. `StateLayout` says which of a model's
tensors are trained, which are buffers, and which are aliases of another.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..data.seeding import GLOBAL_RNG_LOCK as GLOBAL_RNG_LOCK  # (held by whatever draws: see there)
from ..errors import JobConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
# Optimizers whose update of an element reads that element's gradient and state only (their per-tensor
# scalars, as Adam's step count, are the same for every element): a tensor split across data servers
# (`sharding.plan_pieces`) gets the very numbers it gets whole. Not so Adafactor, LAMB, LARS or
# Shampoo, which read a tensor's norms or its rows' and columns' statistics.
ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)
LOSSES: dict[str, LossFn] = {
    "cross_entropy": torch.nn.functional.cross_entropy,
    "mse": torch.nn.functional.mse_loss,
}


@dataclass(frozen=True)
class StateLayout:
    """Which of a model's tensors are trained, which are buffers, and which are aliases (tied weights).

    The servers hold each tensor once, under its first name; an alias is rebuilt when the state is exported.
    Non-persistent buffers are held and used like the others but are not exported, as `state_dict` does.
    """

    params: tuple[str, ...]
    buffers: tuple[str, ...]
    aliases: dict[str, str]  # state_dict key -> the name of the tensor it shares
    exported: tuple[str, ...]  # the model's state_dict keys, in order

    def export(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: tensors[self.aliases.get(key, key)] for key in self.exported}


def state_layout(model: torch.nn.Module) -> StateLayout:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    first_name = {id(t): n for n, t in reversed([*params.items(), *buffers.items()])}
    aliases = {}
    exported = model.state_dict(keep_vars=True)
    for key, tensor in exported.items():
        if key not in params and key not in buffers:
            aliases[key] = first_name[id(tensor)]
    return StateLayout(tuple(params), tuple(buffers), aliases, tuple(exported))


def build_model(path: str) -> torch.nn.Module:
    """A fresh model from the import path of its zero-argument factory (the job's `model`)."""
    factory = resolve_callable(path, "model")
    try:
        module = factory()
    except Exception as exc:
        raise JobConfigError(
            "model", path, f"calling it raised {type(exc).__name__}: {exc}; fix the model factory"
        ) from exc
    if not isinstance(module, torch.nn.Module):
        raise JobConfigError(
            "model",
            path,
            f"returned {type(module).__name__} ({module!r:.80}), not a torch.nn.Module; the callable "
            "must take no arguments and return the model",
        )
    return module


def loss_named(loss: str) -> LossFn:
    """The loss function named by the job's `loss`: a built-in name or an import path."""
    if loss in LOSSES:
        return LOSSES[loss]
    return cast(LossFn, resolve_callable(loss, "loss"))


def build_optimizer(optimizer: dict[str, Any], params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer the job's `optimizer` names (its `name` and keyword arguments), over `params`."""
    options = dict(optimizer)
    name = options.pop("name")
    return OPTIMIZERS[name](params, **options)


class _Unregistered(torch.optim.Optimizer):
    """An optimizer base that keeps its defaults and registers no parameters (`check_optimizer_options`)."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self.defaults = defaults


def check_optimizer_options(optimizer: type[torch.optim.Optimizer], options: dict[str, Any]) -> None:
    """Raise what ``optimizer(params, **options)`` raises for its options (a TypeError for an unknown one, a
    ValueError or RuntimeError for a bad value), without building one: the optimizer's own constructor runs,
    checks and all, over a base that registers no parameters. Registering them imports torch._dynamo, 1.7 s
    of CPU that the process that prepares a job (it never steps an optimizer) would pay only to check."""
    probe = type(f"Checked{optimizer.__name__}", (optimizer, _Unregistered), {})
    probe([torch.zeros(1, requires_grad=True)], **options)


def splits_tensors(optimizer: type[torch.optim.Optimizer], asked: bool | None) -> bool:
    """Whether a job's tensors larger than a data server's share are split across data servers: as
    `asked` (the job's `split_tensors`), else (None) whenever `optimizer` is known to update elementwise.
    Raises JobConfigError when a split is asked for under an optimizer not known to be elementwise."""
    elementwise = optimizer in ELEMENTWISE_OPTIMIZERS
    if asked and not elementwise:
        raise JobConfigError(
            "split_tensors",
            asked,
            f"{optimizer.__name__} is not known to update elementwise (its step may read a tensor's norms or "
            "its rows' statistics), so a tensor split across data servers could train to other numbers; "
            "leave split_tensors unset or set it to False",
        )
    return elementwise if asked is None else asked


def resolve_callable(path: str, field: str) -> Callable[..., Any]:
    """The callable named by the import path 'module:attr.attr'; errors name `field` and the path."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise JobConfigError(field, path, "must be an import path 'module:callable'")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise JobConfigError(
                field,
                path,
                f"module {module_name!r} was not found; install it or put it on PYTHONPATH, on this machine "
                "and on every Dask worker",
            ) from exc
        raise JobConfigError(
            field, path, f"importing {module_name!r} failed: it imports {exc.name!r}, which is not installed"
        ) from exc
    except Exception as exc:
        raise JobConfigError(
            field, path, f"importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    parts = qualname.split(".")
    for depth, part in enumerate(parts):
        try:
            target = getattr(target, part)
        except AttributeError:
            owner = module_name if depth == 0 else f"{module_name}:{'.'.join(parts[:depth])}"
            raise JobConfigError(
                field, path, f"{owner!r} has no attribute {part!r}; check the name after the ':'"
            ) from None
    if not callable(target):
        raise JobConfigError(
            field, path, f"names a {type(target).__name__}, which is not callable; name a function or class"
        )
    return cast(Callable[..., Any], target)
