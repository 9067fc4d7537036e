"""The messages of the step channel, each a small frozen class with its fields and its header (`header`,
`frame`): what a compute loop sends a shard, each with its op, and `decode_message`, the one place that
reads a header's op; and what a shard answers, read by the loop as the answer to what it sent (an answer
has no op). The loop's side (`compute/`) and a standby fetching a replica (`data_server/replicas.py`)
build the messages and read the answers; the shard's side (`data_server/frames.py`) dispatches on the
messages' type and builds the answers.

    Pull        what a loop needs next (`Then`), nothing pushed: a step's first fetch, batches ahead
    Push        a sync share of a step: its losses (and the gradients and buffers the frame carries)
    Part        one micro-batch's gradient of one bucket, during backward (quiet: never answered)
    Apply       async mode: one micro-batch's gradient, applied at once
    Current     async mode: the parameters as they are now
    ReplicaAsk  a standby taking a shard's role: the replica of its snapshot that a peer holds
    Confirm     a straggler's own copies of ids a shard asked a backup of: none of its reads had moved

    Next          the answer to a `Then` (a `Pull`, a `Push`): parameters, buffers, batches, or its error
    ParamsBucket  one bucket of a shard's flat parameters, a frame that follows a `Next`
    Taken         a frame went in, nothing asked for (a `Part`, a `Confirm`)
    Applied       async mode: what became of an `Apply` (and the state after it, if asked)
    CurrentState  async mode: the answer to a `Current`, the shard's version (its state beside it)
    ReplicaSent   the answer to a `ReplicaAsk`: the replica's tensors
    Failed        what a shard answers where handling a frame raised: the error, raised again at the loop

The frame's encoding (the header as JSON, the tensors' bytes, an error's header) is `codec.py`'s; a
message is its header, and the tensors stay in the frame beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .codec import Entry, Frame, error_header, error_of

Entries = list[tuple[Entry, torch.Tensor]]  # a frame's tensors, beside its header


@dataclass(frozen=True)
class Then:
    """What a loop asks a shard for, for its next step: the parameters of `step` (None: none), sent once
    the shard applied the step before, waiting up to `wait` s; and the batches of `batches` that live
    there. `worker`: the asker, whom the shard may ask to train a backup instead (`stragglers.py`; None:
    never); `copy`: the parameters as a copy, never read in place (`wire/published.py`); `buckets`: the
    ranges of the shard's flat parameters to answer bucket by bucket, in forward order (`bucket_pull.py`;
    None: whole)."""

    step: int | None
    wait: float
    batches: list[int] = field(default_factory=list)
    worker: str | None = None
    copy: bool = False
    buckets: list[list[int]] | None = None

    def header(self) -> dict[str, Any]:
        asked: dict[str, Any] = {"step": self.step, "wait": self.wait, "batches": self.batches}
        if self.worker is not None:
            asked["worker"] = self.worker
        if self.copy:
            asked["copy"] = True
        if self.buckets is not None:
            asked["buckets"] = self.buckets
        return asked

    @classmethod
    def of(cls, asked: dict[str, Any] | None) -> Then | None:
        if asked is None:
            return None
        step = asked.get("step")
        return cls(
            None if step is None else int(step),
            float(asked["wait"]),
            [int(b) for b in asked["batches"]],
            asked.get("worker"),
            bool(asked.get("copy")),
            asked.get("buckets") or None,
        )


# What a loop asks one shard for next: a `Then`, or nothing.
Ask = Then | None


class StepMessage:
    """One message of the step channel: its op, and its fields as a frame's header."""

    op: ClassVar[str]

    def fields(self) -> dict[str, Any]:
        """The header's fields but the op: the message's own, where they are what JSON carries."""
        return dict(vars(self))

    def header(self) -> dict[str, Any]:
        return {"op": self.op, **self.fields()}

    def frame(self, tensors: Entries | None = None) -> Frame:
        return Frame(self.header(), tensors if tensors is not None else [])


@dataclass(frozen=True)
class Pull(StepMessage):
    """What a loop needs next (`then`; None: nothing, answered with a bare `ok`), pushing nothing."""

    op: ClassVar[str] = "pull"
    generation: int
    then: Then | None

    def fields(self) -> dict[str, Any]:
        return {"generation": self.generation, "then": None if self.then is None else self.then.header()}

    @classmethod
    def of(cls, header: dict[str, Any]) -> Pull:
        return cls(int(header["generation"]), Then.of(header.get("then")))


@dataclass(frozen=True)
class Push(StepMessage):
    """The gradients, buffers and losses of some batch ids of step `step` (sync mode), from `worker`: every
    batch id the push covers has its loss in `losses`, also where the frame carries no tensor of it to this
    shard. `then`: what the loop needs next, answered once the shard applied the step; `order`: the
    parameters a packed gradient covers (`gradient_entries`); `backup`: trained for a member that did not
    push them (`stragglers.py`); `bucketed`: their gradients came before, in parts (`Part`), and this push
    seals them."""

    op: ClassVar[str] = "push"
    generation: int
    step: int
    worker: str
    losses: dict[int, float]
    then: Then | None = None
    order: list[str] = field(default_factory=list)
    backup: bool = False
    bucketed: bool = False

    def fields(self) -> dict[str, Any]:
        fields = super().fields()
        fields["losses"] = {str(b): loss for b, loss in self.losses.items()}
        fields["then"] = None if self.then is None else self.then.header()
        return fields

    @classmethod
    def of(cls, header: dict[str, Any]) -> Push:
        return cls(
            int(header["generation"]),
            int(header["step"]),
            str(header["worker"]),
            {int(b): float(v) for b, v in header["losses"].items()},
            Then.of(header.get("then")),
            list(header.get("order") or []),
            bool(header.get("backup")),
            bool(header.get("bucketed")),
        )


@dataclass(frozen=True)
class Part(StepMessage):
    """One micro-batch's (`batch`) gradient of one bucket (`bucket`) of the shard's flat parameters, sent
    during backward (sync mode, `overlap_push`); `bounds`: every bucket's range; `backup`: trained for a
    member that did not push it (`stragglers.py`), as the seal after it says. Quiet: the shard answers
    nothing, and the step's push seals the parts."""

    op: ClassVar[str] = "part"
    generation: int
    step: int
    batch: int
    bucket: int
    bounds: list[list[int]]
    backup: bool = False

    def fields(self) -> dict[str, Any]:
        fields = {"quiet": True, **super().fields()}  # (`quiet`: the channel writes and awaits no answer)
        if not self.backup:
            del fields["backup"]  # (a part of a member's own share, nearly every part: no key)
        return fields

    @classmethod
    def of(cls, header: dict[str, Any]) -> Part:
        return cls(
            int(header["generation"]),
            int(header["step"]),
            int(header["batch"]),
            int(header["bucket"]),
            header["bounds"],
            bool(header.get("backup")),
        )


@dataclass(frozen=True)
class Apply(StepMessage):
    """Async mode: the gradient of batch id `batch_id` from `worker`, computed on version `computed_on` of
    the shard, applied at once; `state`: answered with the parameters as they are after it."""

    op: ClassVar[str] = "apply"
    generation: int
    worker: str
    batch_id: int
    computed_on: int
    loss: float
    state: bool = True

    def fields(self) -> dict[str, Any]:
        fields = super().fields()
        fields["then"] = {"state": fields.pop("state")}
        return fields

    @classmethod
    def of(cls, header: dict[str, Any]) -> Apply:
        return cls(
            int(header["generation"]),
            str(header["worker"]),
            int(header["batch_id"]),
            int(header["computed_on"]),
            float(header["loss"]),
            bool((header.get("then") or {}).get("state")),
        )


@dataclass(frozen=True)
class Current(StepMessage):
    """Async mode: the shard's version and its parameters and buffers as they are now."""

    op: ClassVar[str] = "current"
    generation: int

    @classmethod
    def of(cls, header: dict[str, Any]) -> Current:
        return cls(int(header["generation"]))


@dataclass(frozen=True)
class ReplicaAsk(StepMessage):
    """A standby taking shard `source`'s role: the tensors of the replica of its snapshot of `version` that
    this shard, its peer, holds (`DataServer.adopt`)."""

    op: ClassVar[str] = "replica"
    generation: int
    source: int
    version: int

    @classmethod
    def of(cls, header: dict[str, Any]) -> ReplicaAsk:
        return cls(int(header["generation"]), int(header["source"]), int(header["version"]))


@dataclass(frozen=True)
class Confirm(StepMessage):
    """Sync mode: `worker`'s own copies of `batch_ids` of step `step`, which a shard that had asked for a
    backup of them holds aside, go in: every shard took its push of them before applying the step (none
    refused it), so no parameter it read had moved (docs/design/overlapped-step.md, "A straggler reading
    in place")."""

    op: ClassVar[str] = "confirm"
    generation: int
    step: int
    worker: str
    batch_ids: list[int]

    @classmethod
    def of(cls, header: dict[str, Any]) -> Confirm:
        return cls(
            int(header["generation"]),
            int(header["step"]),
            str(header["worker"]),
            [int(b) for b in header["batch_ids"]],
        )


_BY_OP: dict[str, Callable[[dict[str, Any]], StepMessage]] = {
    Pull.op: Pull.of,
    Push.op: Push.of,
    Part.op: Part.of,
    Apply.op: Apply.of,
    Current.op: Current.of,
    ReplicaAsk.op: ReplicaAsk.of,
    Confirm.op: Confirm.of,
}


def decode_message(header: dict[str, Any]) -> StepMessage:
    """The message a frame's header is (the frame's tensors travel beside it)."""
    op = header.get("op")
    decoder = _BY_OP.get(op) if isinstance(op, str) else None
    if decoder is None:
        raise ValueError(f"a frame of no step message: op {op!r}")
    return decoder(header)


class StepAnswer:
    """One answer of the step channel: its fields as a frame's header, which says `ok` (an answer has no
    op: the loop reads it as the answer to what it sent). `unchanging`: its tensors never change once
    sent (`Frame.unchanging`)."""

    unchanging: ClassVar[bool] = False

    def fields(self) -> dict[str, Any]:
        """The header's fields but `ok`: the answer's own, but those it leaves out where unset."""
        return {k: v for k, v in vars(self).items() if v is not None}

    def header(self) -> dict[str, Any]:
        return {"ok": True, **self.fields()}

    def frame(self, tensors: Entries | None = None, following: Iterator[Frame] | None = None) -> Frame:
        return Frame(self.header(), tensors if tensors is not None else [], self.unchanging, following)


@dataclass(frozen=True)
class Failed(StepAnswer):
    """What a shard answers where handling a frame raised (`error`: codec's `error_header`), which the loop
    raises as the same type (`codec.raise_error`); also in place of the frames an answer promised to
    follow, where making one raised, with how many more will not come (`unsent`)."""

    error: dict[str, Any]
    unsent: int = 0

    def header(self) -> dict[str, Any]:
        return {**self.error, "unsent": self.unsent} if self.unsent else dict(self.error)

    @classmethod
    def because(cls, exc: BaseException, unsent: int = 0) -> Failed:
        return cls(error_header(exc), unsent)

    @classmethod
    def of(cls, header: dict[str, Any]) -> Failed:
        return cls({k: v for k, v in header.items() if k != "unsent"}, int(header.get("unsent", 0)))

    def exception(self) -> Exception:
        error = error_of(self.error)
        return error if error is not None else RuntimeError(f"no error in {self.error}")


@dataclass(frozen=True)
class Next(StepAnswer):
    """A shard's answer to a `Then`, with what it carries beside it: from shard `shard` (a loop joins the
    parts of a tensor split across shards by it; None: nothing was asked), its flat parameters (entry
    `params`) under `params`, the names in each flat run of its buffers (entry `buffers` k), the batches
    (entries `x`, `y`); `follow`: its parameters come in that many buckets after it (`ParamsBucket`), a
    flat tensor of `numel` elements of `dtype`. Or, with `error`, what the shard answered instead (not
    applied within the wait, a fence, a backup wanted), after the push before it went in."""

    shard: int | None = None
    params: list[str] | None = None
    buffers: list[list[str]] | None = None
    follow: int = 0
    numel: int | None = None
    dtype: str | None = None
    error: Failed | None = None

    def fields(self) -> dict[str, Any]:
        fields = super().fields()
        if not self.follow:
            del fields["follow"]
        if self.error is not None:
            fields["next_error"] = fields.pop("error").header()
        return fields

    @classmethod
    def failed(cls, exc: BaseException) -> Next:
        return cls(error=Failed.because(exc))

    @classmethod
    def of(cls, header: dict[str, Any]) -> Next:
        shard, numel, error = header.get("shard"), header.get("numel"), header.get("next_error")
        return cls(
            None if shard is None else int(shard),
            header.get("params"),
            header.get("buffers"),
            int(header.get("follow", 0)),
            None if numel is None else int(numel),
            header.get("dtype"),
            None if error is None else Failed.of(error),
        )

    def failure(self) -> Exception | None:
        return None if self.error is None else self.error.exception()

    def check(self) -> None:
        """Raise what the shard answered instead, if it did."""
        if self.error is not None:
            raise self.error.exception()


@dataclass(frozen=True)
class ParamsBucket(StepAnswer):
    """Bucket `bucket` (in forward order) of shard `shard`'s flat parameters, one of the frames that follow
    a `Next` (its `follow`): its one entry is the bucket's run."""

    shard: int
    bucket: int

    @classmethod
    def of(cls, header: dict[str, Any]) -> ParamsBucket:
        return cls(int(header.get("shard", -1)), int(header.get("bucket", -1)))


@dataclass(frozen=True)
class Taken(StepAnswer):
    """A frame went in, and asked for nothing back (a `Part`, a `Confirm`)."""


@dataclass(frozen=True)
class ReplicaSent(StepAnswer):
    """The answer to a `ReplicaAsk`: the replica's tensors, each with its place in the replica's outline as
    its entry's batch id. They never change once sent: sent from their own memory."""

    unchanging: ClassVar[bool] = True


@dataclass(frozen=True)
class Applied(StepAnswer):
    """Async mode: what became of an `Apply` at shard `shard` (`outcome`: applied, or refused as a
    duplicate or as stale) and its `staleness`; where it asked for the state, the shard's `version` after it
    (its parameters and buffers beside it, entries `state`)."""

    outcome: str
    staleness: int
    shard: int
    version: int | None = None

    @classmethod
    def of(cls, header: dict[str, Any]) -> Applied:
        version = header.get("version")
        return cls(
            str(header["outcome"]),
            int(header["staleness"]),
            int(header["shard"]),
            None if version is None else int(version),
        )


@dataclass(frozen=True)
class CurrentState(StepAnswer):
    """Async mode: the answer to a `Current`, shard `shard`'s `version` (its parameters and buffers as they
    are now beside it, entries `state`)."""

    version: int
    shard: int

    @classmethod
    def of(cls, header: dict[str, Any]) -> CurrentState:
        return cls(int(header["version"]), int(header["shard"]))


def is_quiet(header: dict[str, Any]) -> bool:
    """Whether a frame is one the shard never answers (a `Part`)."""
    return bool(header.get("quiet"))


def frames_after(header: dict[str, Any]) -> int:
    """The frames that follow an answer on its connection: a `Next`'s buckets (`follow`), less, for a
    `Failed` in their place, those that will not come (`unsent`)."""
    return int(header.get("follow", 0)) - int(header.get("unsent", 0))
