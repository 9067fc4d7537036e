"""Survival detection as a pure function: state and live workers in, a decision out.

The coordinator calls `survival_check` every `liveness_interval` and at once on a scheduler worker event,
with training suspended, and then carries the decision out; nothing here touches a cluster, so every
sequence of events can be unit-tested.

- Membership unchanged: snapshot (if a step was committed since the last one).
- Membership changed: the generation goes up, and per the job's policy either every shard reloads the last
  snapshot (`rollback`, the patent's rule) or only the step in flight is dropped and trained again
  (`reassign`). When there were no members before (the job starts, or it waited with none), nothing was in
  flight: the workers are admitted (`start`) and nothing is undone.
- Fewer live workers than `min_workers`: no work is handed out; after `min_workers_timeout` the job fails.
- A change that lost nothing, made only of joins and graceful leaves (workers retired: a lifetime or
  walltime that ended, an adaptive scale-down, `retire_workers`), is not rolled back, whatever the policy
  (`spare_what_lost_nothing`): `rollback` is the answer to a loss, and a member that joined or left
  gracefully took nothing with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Action(StrEnum):
    NOTHING = "nothing"  # membership unchanged and nothing new to snapshot
    START = "start"  # the first members are admitted: nothing was in flight, nothing is undone
    SNAPSHOT = "snapshot"
    ROLLBACK = "rollback"
    REASSIGN = "reassign"


class Policy(StrEnum):
    """What a membership change undoes, chosen once per job (`ElasticJob.on_membership_change`, whose
    string values these are): every shard back to the last snapshot, or only the step in flight."""

    ROLLBACK = "rollback"
    REASSIGN = "reassign"

    @property
    def on_change(self) -> Action:
        """The action a membership change of members that held work takes."""
        return _ON_CHANGE[self]


_ON_CHANGE = {Policy.ROLLBACK: Action.ROLLBACK, Policy.REASSIGN: Action.REASSIGN}


@dataclass(frozen=True)
class SurvivalState:
    generation: int
    workers: frozenset[str]
    policy: Policy
    min_workers: int
    min_workers_timeout: float
    committed_steps: int
    snapshot_step: int
    below_min_since: float | None = None  # when live workers first fell below min_workers

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))  # (named by the job's setting's string)


@dataclass(frozen=True)
class Decision:
    action: Action
    generation: int
    workers: frozenset[str]
    joined: frozenset[str]
    left: frozenset[str]
    resume: bool  # hand out work again afterwards
    below_min_since: float | None
    failure: str | None  # set when the job must stop
    reason: str

    @property
    def membership_changed(self) -> bool:
        return bool(self.joined or self.left)


def survival_check(state: SurvivalState, live_workers: frozenset[str] | set[str], now: float) -> Decision:
    live = frozenset(live_workers)
    joined = live - state.workers
    left = state.workers - live
    changed = bool(joined or left)

    if changed and not state.workers:
        action = Action.START
        generation = state.generation + 1
        reason = _describe(joined, left)
    elif changed:
        action = state.policy.on_change
        generation = state.generation + 1
        reason = _describe(joined, left)
    else:
        generation = state.generation
        if state.committed_steps > state.snapshot_step:
            action, reason = Action.SNAPSHOT, "membership unchanged"
        else:
            action, reason = Action.NOTHING, "membership unchanged, no step since the last snapshot"

    if len(live) >= state.min_workers:
        return Decision(action, generation, live, joined, left, True, None, None, reason)

    since = state.below_min_since if state.below_min_since is not None else now
    waited = now - since
    failure = None
    if waited >= state.min_workers_timeout:
        failure = (
            f"only {len(live)} live compute worker(s), fewer than min_workers={state.min_workers}, "
            f"for {waited:.1f} s (min_workers_timeout={state.min_workers_timeout:g} s); add elastic "
            "workers to the cluster or lower min_workers"
        )
    reason = f"{reason}; waiting for workers ({len(live)} of min_workers={state.min_workers})"
    if action is Action.SNAPSHOT:
        # Nothing moves while waiting; the snapshot taken before the wait is still the latest state.
        action = Action.NOTHING
    return Decision(action, generation, live, joined, left, False, since, failure, reason)


def _describe(joined: frozenset[str], left: frozenset[str]) -> str:
    parts = []
    if left:
        parts.append("lost " + ", ".join(sorted(left)))
    if joined:
        parts.append("joined " + ", ".join(sorted(joined)))
    return "; ".join(parts)


def spare_what_lost_nothing(decision: Decision, graceful: frozenset[str]) -> Decision:
    """A rollback whose change lost nothing becomes a reassign: one made only of joins (every member is
    still there, so the step in flight can end on every shard: `finishes_the_step_in_flight` in
    coordinator/actor.py) and of workers that left gracefully (their last step is whole or not made),
    so at most the step in flight is trained again. A loss in the same change keeps the policy's
    rollback. (The parameters are the same either way: the reconcile still rolls back where the shards
    stand a version apart.)"""
    if decision.action is not Action.ROLLBACK or not decision.membership_changed:
        return decision
    if not decision.left <= graceful:
        return decision
    why = (
        "they left gracefully"
        if not decision.joined
        else "only joins"
        if not decision.left
        else "only joins and graceful leaves"
    )
    return replace(
        decision, action=Action.REASSIGN, reason=f"{decision.reason}; {why}, so nothing is rolled back"
    )
