"""Making one batch id's batch (`BatchMaker.make`): its samples by the schedule, each read with the global
random generators seeded for that sample, collated, and named.

The same function runs wherever the pipeline runs (a data server's reader thread, a compute worker's batch
process, the controller's look at the first samples), so a batch has the same bits wherever, by whichever
worker, in whichever generation it is made:

- the samples are the schedule's (`Schedule.samples`: the epoch and the global indices, fixed by the seed);
- while a sample of a user's own Dataset is read, torch's, NumPy's legacy and Python's global generators
  (the ones a user's `__getitem__` and torchvision's transforms draw from) are seeded from (the job's seed,
  the epoch, the sample's index), and put back as they were after (`seeded_sample`), so a random crop is the
  same crop on any worker;
- the samples are collated by torch's `default_collate`, or the job's `collate` (an import path), and the
  result is named (`named_batch`): a dict's keys, a tuple's positions "0", "1", ...

A columnar source whose fields all have one shape (an `.npz` dataset, fixed-size Parquet columns) skips the
per-sample path: its rows come stacked (`Source.rows`), the same values and dtypes `default_collate` gives.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from ..job.build import resolve_callable
from ..schedule import Schedule
from ..wire.signals import DataFailure
from .fields import Batch, StepFields
from .seeding import sample_seed, seeded_sample
from .sources import SourceInfo, only_fields, open_source

__all__ = ["BatchMaker", "BatchSpec", "named_batch"]


@dataclass(frozen=True)
class BatchSpec:
    """What makes a job's batches, in any process: picklable, made once when the job is prepared."""

    source: SourceInfo
    schedule: Schedule
    seed: int  # the job's: with the epoch and the sample's index, the seed of a sample's random draws
    fields: StepFields
    collate: str | None = None  # the import path of a collate function; None: torch's default_collate
    cache_bytes: int = 256 * 2**20  # the source's blocks kept in memory at most (`open_source`)
    on_compute: bool = False  # the compute workers make the batches (else the data servers serve them)
    prefetch: int = 4  # the batches a reader makes ahead of the step that needs them


def named_batch(collated: Any, used: Sequence[str]) -> Batch:
    """A collated batch as named tensors (only the fields in `used`): a mapping's keys, a tuple's or
    list's positions "0", "1", ...; a lone tensor is field "0"."""
    if isinstance(collated, Mapping):
        fields = {str(k): v for k, v in collated.items()}
    elif isinstance(collated, (tuple, list)):
        fields = {str(i): v for i, v in enumerate(collated)}
    else:
        fields = {"0": collated}
    batch: Batch = {}
    for name in used:
        if name not in fields:
            have = ", ".join(repr(n) for n in fields) or "none"
            raise KeyError(f"the collated batch has no field {name!r} (it has {have})")
        value = fields[name]
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(np.asarray(value))
        batch[name] = value
    return batch


class BatchMaker:
    """Makes batch ids' batches from the job's source (opened here, read block by block within the
    spec's cache bound)."""

    def __init__(self, spec: BatchSpec) -> None:
        self.spec = spec
        # (Only the fields the step reads, unless a collate of the user's may read others: a columnar
        # source then reads only those columns, and stacks them though another, a text, would not.)
        source = spec.source if spec.collate is not None else only_fields(spec.source, spec.fields.used)
        self.source = open_source(source, spec.cache_bytes)
        self.collate = default_collate if spec.collate is None else resolve_callable(spec.collate, "collate")
        # Where no user code runs on a sample (a columnar source, torch's collate), rows come stacked.
        self.stacked = spec.collate is None and spec.source.kind != "factory"
        self.draws = spec.source.kind == "factory"  # a user's __getitem__ may draw random numbers

    def close(self) -> None:
        self.source.close()

    def make(self, batch_id: int) -> Batch:
        """Batch id `batch_id`'s fields, as the step reads them (a `DataFailure` names the batch id and
        the sample where one did not read or the samples did not collate)."""
        epoch, indices = self.spec.schedule.samples(batch_id)
        return self.of_samples(batch_id, epoch, [int(i) for i in indices])

    def of_samples(self, batch_id: int, epoch: int, indices: Sequence[int]) -> Batch:
        """The batch of the samples `indices` (global) of `epoch`, as batch id `batch_id` has them."""
        used = self.spec.fields.used
        step = self.spec.schedule.step_of(batch_id)
        if self.stacked:
            try:
                rows = self.source.rows(indices)
            except Exception as exc:
                raise DataFailure(step, batch_id, self._said(batch_id, indices, exc)) from exc
            if rows is not None:
                return named_batch({n: torch.from_numpy(np.ascontiguousarray(rows[n])) for n in used}, used)
        items = [self._item(step, batch_id, epoch, i) for i in indices] if self.draws else None
        if items is None:
            try:
                items = self.source.items(indices)
            except Exception as exc:
                raise DataFailure(step, batch_id, self._said(batch_id, indices, exc)) from exc
        try:
            return named_batch(self.collate(items), used)
        except Exception as exc:
            raise DataFailure(step, batch_id, self._not_batched(batch_id, indices, items, exc)) from exc

    def _item(self, step: int, batch_id: int, epoch: int, index: int) -> Any:
        try:
            # (Under the lock, `seeded_sample`: in a data server's reader thread, another thread may draw from
            # the same generators.)
            with seeded_sample(sample_seed(self.spec.seed, epoch, index)):
                return self.source.items([index])[0]
        except Exception as exc:
            raise DataFailure(step, batch_id, self._said(batch_id, [index], exc)) from exc

    def _said(self, batch_id: int, indices: Sequence[int], exc: BaseException) -> str:
        where = f"sample {indices[0]}" if len(indices) == 1 else f"the samples {list(indices)[:8]}"
        return (
            f"{where} of batch {batch_id} of {self.spec.source.setting} {self.spec.source.url} could not be "
            f"read: {type(exc).__name__}: {exc}; {_look_at(len(indices))}"
        )

    def _not_batched(
        self, batch_id: int, indices: Sequence[int], items: list[Any], exc: BaseException
    ) -> str:
        """Why the samples did not collate, naming the sample at fault where one is: the one whose form
        (types, shapes, dtypes) differs from the others', or the one the collate refuses alone."""
        how = "torch's default_collate" if self.spec.collate is None else f"collate {self.spec.collate!r}"
        hint = (
            "; samples of varying length need a collate that pads them (collate='module:function')"
            if self.spec.collate is None
            else ""
        )
        raised = f"{how} raised {type(exc).__name__}: {exc}"
        of = f"of batch {batch_id} of {self.spec.source.setting} {self.spec.source.url}"
        forms = [_form(item) for item in items]
        common, count = Counter(forms).most_common(1)[0]
        odd = [k for k, form in enumerate(forms) if form != common]
        if odd and count > len(items) / 2:
            k = odd[0]
            more = (
                f" (and {len(odd) - 1} more: the samples {[indices[j] for j in odd[1:8]]})" if odd[1:] else ""
            )
            return (
                f"sample {indices[k]} {of} does not batch with the others{more}: "
                f"{_difference(items[k], items[forms.index(common)])} ({raised}); {_look_at(1)}"
            )
        alone = [k for k, item in enumerate(items) if not self._collates([item])]
        if len(alone) == 1:
            return f"sample {indices[alone[0]]} {of} does not batch ({raised}); {_look_at(1)}"
        return (
            f"{how} could not batch the samples {list(indices)[:8]} {of}: {type(exc).__name__}: {exc}{hint}"
        )

    def _collates(self, items: list[Any]) -> bool:
        try:
            named_batch(self.collate(items), self.spec.fields.used)
        except Exception:
            return False
        return True


def _look_at(count: int) -> str:
    it = "that sample" if count == 1 else "those samples"
    return f"look at {it} in the data (fix or remove {'it' if count == 1 else 'them'}) and run the job again"


def _form(value: Any) -> str:
    """A sample's (or a field's) types, shapes and dtypes, not its values."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} {value.dtype}"
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} {value.dtype}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_form(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        if len(value) > 8:  # (a list of tokens: its length, not each one's)
            return f"a {type(value).__name__} of {len(value)} items"
        return "(" + ", ".join(_form(v) for v in value) + ")"
    return f"a {type(value).__name__}"


def _difference(odd: Any, usual: Any) -> str:
    """What sets `odd` apart from `usual`: the first field whose form differs, where both have fields."""
    if isinstance(odd, Mapping) and isinstance(usual, Mapping) and odd.keys() == usual.keys():
        pairs = [(str(k), odd[k], usual[k]) for k in odd]
    elif isinstance(odd, (tuple, list)) and isinstance(usual, (tuple, list)) and len(odd) == len(usual):
        pairs = [(str(i), a, b) for i, (a, b) in enumerate(zip(odd, usual, strict=True))]
    else:
        pairs = []
    for name, a, b in pairs:
        if _form(a) != _form(b):
            return f"its field {name!r} is {_form(a)} where the others' is {_form(b)}"
    return f"it is {_form(odd)} where the others are {_form(usual)}"
