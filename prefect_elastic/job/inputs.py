"""The expensive checks of a job, run once before any cluster work: its dataset against its settings.

`check_dataset` reads only the dataset's headers (`inspect_dataset`): whether the job's loss takes the
dataset's targets (the npy header of `y`), and whether every data server's partition holds at least one
batch. Each refusal is a `JobConfigError` that names the field to change and how.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..dataset import DatasetInfo, inspect_dataset, partition_bounds
from ..errors import JobConfigError


def check_dataset(
    dataset: str, storage: dict[str, Any], loss: str, data_servers: int, batch_size: int
) -> DatasetInfo:
    """The dataset at `dataset` (opened with the fsspec options `storage`), refused when the `loss` cannot
    take its targets or when a partition of it over `data_servers` holds less than one batch."""
    info = inspect_dataset(dataset, storage)
    _check_targets(loss, info)
    smallest = min(
        stop - start
        for start, stop in (partition_bounds(info.total, data_servers, i) for i in range(data_servers))
    )
    if smallest < batch_size:
        fits = info.total // batch_size
        fixes = []
        if smallest >= 1:
            fixes.append(f"lower batch_size to at most {smallest}")
        if fits >= 1:
            fixes.append(f"lower data_servers to at most {fits}")
        if not fixes:
            fixes.append(f"lower data_servers to 1 and batch_size to at most {info.total}")
        problem = (
            f"the dataset {dataset} has {info.total} samples, so with data_servers="
            f"{data_servers} the smallest partition holds {smallest} samples, fewer than one batch "
            f"of batch_size={batch_size}; {' or '.join(fixes)}, or add samples"
        )
        # An empty partition is data_servers' fault alone: no batch_size can fill it.
        if smallest == 0:
            raise JobConfigError("data_servers", data_servers, problem)
        raise JobConfigError("batch_size", batch_size, problem)
    return info


def _check_targets(loss: str, info: DatasetInfo) -> None:
    """Refuse targets whose dtype the built-in `loss` cannot take, from the npy header of `y` alone (a loss
    given by import path is the user's to check)."""
    y = np.dtype(info.y_dtype)
    per_sample = f"shape {info.y_shape} per sample" if info.y_shape else "one value per sample"
    shown = f"{y.name} with {per_sample}"
    if loss == "cross_entropy":
        if y in (np.dtype(np.int64), np.dtype(np.uint8)):
            return  # class indices, as torch takes them
        if y.kind == "f" and info.y_shape:
            return  # class probabilities: one value per class
        if y.kind == "f":
            raise JobConfigError(
                "loss",
                loss,
                f"the targets 'y' of {info.url} are {shown}, but cross_entropy takes class indices (an "
                "integer 'y', int64) or class probabilities (a float 'y' with one value per class); for "
                "regression targets give loss='mse', for class labels write 'y' as int64 "
                "(numpy.savez(f, x=x, y=y.astype(numpy.int64)))",
            )
        if y.kind in "iub":
            raise JobConfigError(
                "dataset",
                info.url,
                f"its targets 'y' are {shown}, but cross_entropy takes class indices as int64 (or uint8) "
                "only; write 'y' as int64 (numpy.savez(f, x=x, y=y.astype(numpy.int64)))",
            )
        raise JobConfigError(
            "dataset",
            info.url,
            f"its targets 'y' are {shown}, which cross_entropy cannot take; write 'y' as int64 class "
            "indices or as float class probabilities",
        )
    if loss == "mse" and y.kind != "f":
        raise JobConfigError(
            "loss",
            loss,
            f"the targets 'y' of {info.url} are {shown}, but mse compares the output with float targets; "
            "for class labels give loss='cross_entropy', for numeric targets write 'y' as float32 "
            "(numpy.savez(f, x=x, y=y.astype(numpy.float32)))",
        )
