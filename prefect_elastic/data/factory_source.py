"""A user's own Dataset as a source: the import path `"module:factory"` of a callable that takes no
arguments and returns a map-style `torch.utils.data.Dataset` (one with `__getitem__` and `__len__`) whose
items are tuples or dicts of tensors, arrays or numbers.

Inspecting calls the factory and reads item 0, to learn the fields: a tuple's positions "0", "1", ... or a
dict's keys, each with item 0's dtype as a hint (its shape is None: only one item is looked at). Every
process that reads calls the factory again (`FactorySource`); so that a factory which draws random numbers
(a random split, synthetic data) builds the same dataset in each, it runs with the global generators
(torch's, NumPy's legacy one, Python's) seeded with `FACTORY_SEED` and put back after. Item 0 is read the
same way at inspection, so that looking at it does not move this process's generators.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .seeding import seeded_sample
from .source_info import FieldInfo, SourceInfo, refusal

__all__ = ["FACTORY_SEED", "FactorySource", "inspect_factory"]

FACTORY_SEED = 0


def _dtype_of(value: Any) -> str | None:
    """A field's numpy dtype str from one sample's value; None where it is not a number or an array."""
    if isinstance(value, torch.Tensor):
        try:
            return str(torch.empty((), dtype=value.dtype).numpy().dtype.str)
        except TypeError:
            return None  # bfloat16 and others numpy has no dtype for
    if isinstance(value, np.ndarray | np.generic):
        return None if value.dtype.hasobject else str(value.dtype.str)
    if isinstance(value, bool | int | float):
        return str(np.asarray(value).dtype.str)
    return None


def _build(setting: str, value: str) -> Any:
    """The factory's dataset, checked to be map-style with a length (every refusal names `setting`)."""
    # (Imported here: the job package's settings import this package, so a top-level import would loop.)
    from ..job.build import resolve_callable

    factory = resolve_callable(value, setting)
    try:
        with seeded_sample(FACTORY_SEED):
            dataset = factory()
    except Exception as exc:
        raise refusal(
            setting, value, f"the factory raised {type(exc).__name__}: {exc}; it is called with no arguments"
        ) from exc
    kind = type(dataset).__name__
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise refusal(
            setting,
            value,
            f"the factory returned an IterableDataset ({kind}); it must return a map-style "
            "torch.utils.data.Dataset (with __getitem__ and __len__), whose samples can be read by index",
        )
    if isinstance(dataset, str | bytes | Mapping) or not hasattr(dataset, "__getitem__"):
        raise refusal(
            setting,
            value,
            f"the factory returned a {kind}, not a Dataset; it must return a map-style "
            "torch.utils.data.Dataset (with __getitem__ and __len__)",
        )
    if not hasattr(dataset, "__len__"):
        raise refusal(
            setting,
            value,
            f"the factory's {kind} has no __len__; define it (the number of samples): the schedule needs it",
        )
    return dataset


def _length(setting: str, value: str, dataset: Any) -> int:
    try:
        length = len(dataset)
    except Exception as exc:
        raise refusal(
            setting,
            value,
            f"len() of the factory's {type(dataset).__name__} raised {type(exc).__name__}: {exc}",
        ) from exc
    if length == 0:
        raise refusal(
            setting, value, f"the factory's {type(dataset).__name__} is empty; there is nothing to train on"
        )
    return int(length)


def inspect_factory(setting: str, value: str) -> SourceInfo:
    """The factory's Dataset described by its length and its item 0."""
    dataset = _build(setting, value)
    length = _length(setting, value, dataset)
    kind = type(dataset).__name__
    try:
        with seeded_sample(FACTORY_SEED):
            first = dataset[0]
    except Exception as exc:
        raise refusal(
            setting, value, f"reading item 0 of the {kind} raised {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(first, tuple | list):
        fields = tuple(FieldInfo(str(i), None, _dtype_of(v)) for i, v in enumerate(first))
        tuple_items = True
    elif isinstance(first, Mapping):
        fields = tuple(FieldInfo(str(k), None, _dtype_of(v)) for k, v in first.items())
        tuple_items = False
    else:
        raise refusal(
            setting,
            value,
            f"item 0 of the {kind} is a {type(first).__name__}; items must be tuples (inputs, target) or "
            "dicts of named fields, of tensors, arrays or numbers",
        )
    if not fields:
        raise refusal(setting, value, f"item 0 of the {kind} is empty; it must hold at least one field")
    return SourceInfo(
        setting=setting,
        url=value,
        kind="factory",
        length=length,
        fields=fields,
        tuple_items=tuple_items,
        blocks=(),
        object_store=False,
    )


class FactorySource:
    """The factory's Dataset in this process: its items as `dataset[i]` returns them."""

    def __init__(self, info: SourceInfo, cache_bytes: int = 0) -> None:
        self.info = info
        self.cache_bytes = cache_bytes  # (unused: a Dataset keeps what it keeps)
        self.dataset = _build(info.setting, info.url)
        length = _length(info.setting, info.url, self.dataset)
        if length != info.length:
            raise refusal(
                info.setting,
                info.url,
                f"the factory's dataset has {length} samples here but had {info.length} when the job was "
                "prepared; a factory must build the same dataset in every process",
            )

    def __len__(self) -> int:
        return self.info.length

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.info, self.cache_bytes))

    def items(self, indices: Sequence[int]) -> list[Any]:
        return [self.dataset[int(i)] for i in indices]

    def rows(self, indices: Sequence[int]) -> dict[str, np.ndarray] | None:
        return None  # a user's items may differ in shape, and each goes through the collate

    def close(self) -> None:
        """Nothing of this module's is open: the Dataset is the user's, and lives as long as this object."""
