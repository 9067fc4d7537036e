"""The expensive checks of a job, run once before any cluster work: its dataset against its settings.

`check_dataset` reads only the dataset's headers and metadata (`inspect_source`): which fields the step
takes (`resolve_fields`), whether the job's loss takes the target's dtype where the source tells it, and
whether every data server's partition holds at least one batch. Each refusal is a `JobConfigError` that
names the field to change and how.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..data.fields import StepFields, resolve_fields
from ..data.sources import SourceInfo, inspect_source
from ..dataset import partition_bounds
from ..errors import JobConfigError


def check_dataset(
    dataset: str,
    storage: dict[str, Any],
    loss: str,
    data_servers: int,
    batch_size: int,
    inputs: str | list[str] | None = None,
    target: str | None = None,
) -> tuple[SourceInfo, StepFields]:
    """The dataset at `dataset` (opened with the fsspec options `storage`) and the fields a step takes
    from it, refused when the `loss` cannot take its targets or when a partition of it over
    `data_servers` holds less than one batch."""
    info = inspect_source("dataset", dataset, storage)
    fields = resolve_fields(info.names, info.tuple_items, inputs, target, loss, f"{info.setting} {dataset}")
    target_field = info.field(fields.target) if fields.target is not None else None
    if target_field is not None and target_field.dtype is not None and not fields.model_loss:
        _check_targets(loss, dataset, fields.target or "y", np.dtype(target_field.dtype), target_field.shape)
    total = info.length
    smallest = min(
        stop - start
        for start, stop in (partition_bounds(total, data_servers, i) for i in range(data_servers))
    )
    if smallest < batch_size:
        fits = total // batch_size
        fixes = []
        if smallest >= 1:
            fixes.append(f"lower batch_size to at most {smallest}")
        if fits >= 1:
            fixes.append(f"lower data_servers to at most {fits}")
        if not fixes:
            fixes.append(f"lower data_servers to 1 and batch_size to at most {total}")
        problem = (
            f"the dataset {dataset} has {total} samples, so with data_servers="
            f"{data_servers} the smallest partition holds {smallest} samples, fewer than one batch "
            f"of batch_size={batch_size}; {' or '.join(fixes)}, or add samples"
        )
        # An empty partition is data_servers' fault alone: no batch_size can fill it.
        if smallest == 0:
            raise JobConfigError("data_servers", data_servers, problem)
        raise JobConfigError("batch_size", batch_size, problem)
    return info, fields


def _check_targets(loss: str, url: str, name: str, y: np.dtype[Any], y_shape: tuple[int, ...] | None) -> None:
    """Refuse targets whose dtype the built-in `loss` cannot take, from the source's header or schema
    alone (a loss given by import path is the user's to check)."""
    per_sample = (
        "a varying shape per sample" if y_shape is None
        else f"shape {y_shape} per sample" if y_shape else "one value per sample"
    )  # fmt: skip
    shown = f"{y.name} with {per_sample}"
    several = bool(y_shape) or y_shape is None
    if loss == "cross_entropy":
        if y in (np.dtype(np.int64), np.dtype(np.uint8)):
            return  # class indices, as torch takes them
        if y.kind == "f" and several:
            return  # class probabilities: one value per class
        if y.kind == "f":
            raise JobConfigError(
                "loss",
                loss,
                f"the targets {name!r} of {url} are {shown}, but cross_entropy takes class indices (an "
                "integer 'y', int64) or class probabilities (a float 'y' with one value per class); for "
                "regression targets give loss='mse', for class labels write 'y' as int64 "
                "(numpy.savez(f, x=x, y=y.astype(numpy.int64)))",
            )
        if y.kind in "iub":
            raise JobConfigError(
                "dataset",
                url,
                f"its targets {name!r} are {shown}, but cross_entropy takes class indices as int64 (or "
                "uint8) only; write 'y' as int64 (numpy.savez(f, x=x, y=y.astype(numpy.int64)))",
            )
        raise JobConfigError(
            "dataset",
            url,
            f"its targets {name!r} are {shown}, which cross_entropy cannot take; write 'y' as int64 class "
            "indices or as float class probabilities",
        )
    if loss == "mse" and y.kind != "f":
        raise JobConfigError(
            "loss",
            loss,
            f"the targets {name!r} of {url} are {shown}, but mse compares the output with float targets; "
            "for class labels give loss='cross_entropy', for numeric targets write 'y' as float32 "
            "(numpy.savez(f, x=x, y=y.astype(numpy.float32)))",
        )
