"""What one checkpoint holds, its bytes, and whether it belongs to a job.

A checkpoint holds the parameters, buffers and optimizer state of every shard as of one snapshot, the
ledger up to that snapshot, the loss history, the generation, and a fingerprint of the job and the model.
It is written with `torch.save` and read with `torch.load(weights_only=True)` (tensors, numbers, strings,
lists and dicts only: never plain pickle). `fingerprint` is what a checkpoint must agree on to resume a
job; `check_compatible` refuses one of another job or model.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointMismatchError, FatalError
from ..job import CheckpointSpec, StateLayout
from ..ledger import LedgerEntry

# 2: the ledger has a 4th column, async mode's staleness; 3: the optimizer's state whole, by the model's
# tensor names (`optimizer`), not one state_dict per shard. Formats 1 and 2 are still read.
FORMAT = 3


@dataclass(frozen=True)
class Checkpoint:
    job_id: str
    fingerprint: dict[str, Any]  # job fields and model layout; see `fingerprint`
    generation: int
    committed_steps: int
    ledger: list[LedgerEntry]
    history: list[float]
    tensors: dict[str, torch.Tensor]  # parameters and buffers, each once (see StateLayout)
    # Formats 1 and 2: one optimizer state_dict per shard, under the plan of whole tensors that the job's
    # `data_servers` and `min_shard_bytes` made (`Persistence.whole_optimizer` reads it by name).
    optimizers: list[dict[str, Any]]
    # Async mode: each shard's version, and the batch ids it had applied (sync: every shard is at
    # `committed_steps`, and the ledger says what was applied).
    versions: tuple[int, ...] = ()
    applied: tuple[tuple[int, ...], ...] = ()
    # The optimizer's state by tensor name, each entry whole (`checkpoint.optimizer_state`); None in a
    # checkpoint of format 1 or 2.
    optimizer: dict[str, Any] | None = None
    # Which pieces each shard held (`plan_pieces`: name, first element, end), as written; () before format 3.
    plan: tuple[tuple[tuple[str, int, int], ...], ...] = ()

    def to_bytes(self) -> bytes:
        payload = {
            "format": FORMAT,
            "job_id": self.job_id,
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True),
            "generation": self.generation,
            "committed_steps": self.committed_steps,
            "ledger": torch.tensor(
                [[e.batch_id, e.step, e.generation, e.staleness] for e in self.ledger], dtype=torch.int64
            ).reshape(-1, 4),
            "ledger_workers": [e.worker for e in self.ledger],
            "history": torch.tensor(self.history, dtype=torch.float64),
            "tensors": self.tensors,
            "optimizers": self.optimizers,
        }
        if self.optimizer is not None:
            payload["optimizer"] = self.optimizer
            payload["plan"] = [[list(piece) for piece in pieces] for pieces in self.plan]
        if self.versions:
            payload["versions"] = torch.tensor(self.versions, dtype=torch.int64)
            payload["applied"] = [torch.tensor(ids, dtype=torch.int64) for ids in self.applied]
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Checkpoint:
        try:
            payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            if payload.get("format") not in (1, 2, FORMAT):
                raise ValueError(f"format {payload.get('format')!r}, expected {FORMAT}")
            rows = payload["ledger"].tolist()
            workers = payload["ledger_workers"]
            return cls(
                job_id=payload["job_id"],
                fingerprint=json.loads(payload["fingerprint"]),
                generation=int(payload["generation"]),
                committed_steps=int(payload["committed_steps"]),
                # (A ledger of 3 columns was written before async mode's staleness was kept: 0 there.)
                ledger=[
                    LedgerEntry(b, s, g, w, *rest) for (b, s, g, *rest), w in zip(rows, workers, strict=True)
                ],
                history=[float(v) for v in payload["history"].tolist()],
                tensors=dict(payload["tensors"]),
                optimizers=list(payload["optimizers"]),
                versions=tuple(int(v) for v in payload.get("versions", torch.zeros(0)).tolist()),
                applied=tuple(tuple(int(b) for b in t.tolist()) for t in payload.get("applied", [])),
                optimizer=payload.get("optimizer"),
                plan=tuple(
                    tuple((str(n), int(a), int(b)) for n, a, b in pieces)
                    for pieces in payload.get("plan", [])
                ),
            )
        except Exception as exc:
            raise FatalError(
                f"checkpoint {where} cannot be read ({type(exc).__name__}: {exc}); it is not a "
                "prefect-elastic checkpoint of this version, or it was damaged; move it away to start afresh"
            ) from exc


def fingerprint(
    spec: CheckpointSpec, layout: StateLayout, tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """What a checkpoint must agree on to resume a job: the job fields that decide the result
    (`spec.fingerprint_fields`), and the model's tensors (names, shapes, dtypes)."""
    model = {n: [list(t.shape), str(t.dtype)] for n, t in tensors.items()}
    return {
        "job": json.loads(json.dumps(spec.fingerprint_fields, sort_keys=True, default=str)),
        "model": model,
        "model_digest": hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:16],
        "aliases": dict(sorted(layout.aliases.items())),
    }


def check_compatible(found: Checkpoint, expected: dict[str, Any], where: str) -> None:
    if found.fingerprint.get("model") != expected["model"]:
        theirs, ours = found.fingerprint.get("model", {}), expected["model"]
        differ = sorted(set(theirs) ^ set(ours)) or sorted(k for k in ours if theirs.get(k) != ours[k])
        raise CheckpointMismatchError(
            f"checkpoint {where} holds another model: its tensors differ from this job's model in "
            f"{', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''}; point `checkpoint` at another "
            "folder, or remove that checkpoint to start afresh"
        )
    theirs_job, ours_job = found.fingerprint.get("job", {}), expected["job"]
    fields = sorted(k for k in ours_job if theirs_job.get(k) != ours_job[k])
    if fields:
        detail = "; ".join(f"{k}: checkpoint {theirs_job.get(k)!r}, job {ours_job[k]!r}" for k in fields)
        raise CheckpointMismatchError(
            f"checkpoint {where} belongs to another job ({detail}); resuming would not give the same "
            "model. Point `checkpoint` at another folder, or remove that checkpoint to start afresh"
        )
