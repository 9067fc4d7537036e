"""The limits of the job's settings that the cheap checks hold them to (`settings.ElasticJob`'s validators):
what each positive setting means, the import path's form, the job id's characters."""

from __future__ import annotations

import math
import re
from typing import Any

import fsspec

NON_NEGATIVE_OPTIONS = ("lr", "momentum", "weight_decay", "eps", "dampening")
JOB_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

# What each positive setting means, so that the error says why a value of 0 cannot work.
AT_LEAST_ONE = {
    "batch_size": "samples in one micro-batch (one batch id)",
    "micro_batches": "micro-batches whose gradients are summed into one step",
    "epochs": "passes over the dataset",
    "data_servers": "each data server holds one data partition, and a share of a big model's parameters",
    "threads_per_worker": "torch threads of each compute worker",
    "min_workers": "compute workers training needs to go on",
    "checkpoint_every": "snapshots between two persistent checkpoints",
    "checkpoint_keep": "persistent checkpoints kept before older ones are pruned",
    "shuffle_window": "blocks whose samples are shuffled together",
}
POSITIVE_SECONDS = {
    "liveness_interval": "how often survival detection runs",
    "min_workers_timeout": "how long training waits with fewer than min_workers",
    "call_timeout": "how long one remote call may take before it is an error",
}
TORCH_SEED_RANGE = (-(2**63), 2**64 - 1)
# What the callable of each import-path setting must be.
IMPORT_PATHS_OF = {
    "model": "zero-argument callable that returns a torch.nn.Module",
    "collate": "function that takes a list of samples and returns their batch (as default_collate does)",
}


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_non_negative(value: Any) -> bool:
    return is_number(value) and value >= 0


def options_by_protocol(value: Any) -> Any:
    """`storage_options` as fsspec's configuration has them: a mapping of options under each protocol."""
    example = "e.g. {'s3': {'endpoint_url': 'http://127.0.0.1:9000'}}"
    if not isinstance(value, dict):
        raise ValueError(f"must map each protocol to its fsspec options, {example}")
    known = set(fsspec.available_protocols())
    for protocol, options in value.items():
        if not isinstance(options, dict):
            raise ValueError(
                f"maps {protocol!r} to {options!r:.60}, not to a mapping of options; the options go "
                f"under the protocol of the URLs they are for, {example}"
            )
        if protocol not in known:
            raise ValueError(
                f"{protocol!r} is not a protocol fsspec knows (the part of a URL before '://', such as "
                f"'s3', 'gs', 'file'); the options go under the protocol of the URLs they are for, "
                f"{example}"
            )
    return value
