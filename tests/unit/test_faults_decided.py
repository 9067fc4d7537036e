"""Every fault docs/faults.md lists is either decided by a pure function that a unit test here drives
without a cluster (the controller's membership decision, the coordinator's survival check and commit book,
the shard's apply, the standby choice), or says why no membership decision is involved. A row added to the
page without either fails this test, and so does a unit test named below that no longer exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ROOT / "docs" / "faults.md"

M = "test_membership"
S = "test_survival"
W = "test_workers_view"
C = "test_coordinator_state"
F = "test_coordinator_failures"
R = "test_coordinator_rebuild"
B = "test_standby_choice"
T = "test_stragglers"

# A row of the page's table, by the start of its first cell -> the unit tests that decide it, or why there
# is no decision to test without a cluster.
DECIDED: dict[str, list[str] | str] = {
    "compute worker SIGKILL": [
        f"{M}::test_a_compute_worker_lost_is_a_check_once_the_members_left_answered",
        f"{M}::test_two_kills_within_the_loss_window_are_one_change",
        f"{S}::test_lost_worker_bumps_generation_and_applies_policy",
    ],
    "compute worker killed between its pushes": [
        f"{C}::test_shards_a_version_apart_go_back_to_the_snapshot_even_with_reassign",
        f"{C}::test_a_shard_a_step_ahead_that_keeps_the_step_before_steps_back_instead_of_a_restore",
    ],
    "compute worker SIGTERM": [
        f"{M}::test_a_graceful_leave_is_checked_like_any_change",
        f"{S}::test_a_change_that_lost_nothing_is_not_rolled_back",
    ],
    "graceful retire": [
        f"{M}::test_a_graceful_leave_is_checked_like_any_change",
        f"{S}::test_a_change_that_lost_nothing_is_not_rolled_back",
    ],
    "nanny restart": [
        f"{M}::test_a_nanny_restart_is_a_leave_then_a_join",
        f"{S}::test_replaced_worker_same_count_is_a_change",
    ],
    "join, group of joins": [
        f"{M}::test_a_join_is_admitted_once_it_runs_not_while_it_starts",
        f"{M}::test_a_group_of_joins_is_held_while_more_are_on_their_way_for_at_most_a_liveness_interval",
        f"{S}::test_joined_worker_is_a_membership_change_too",
    ],
    "frozen worker": [
        f"{M}::test_a_frozen_member_is_out_once_the_view_drops_it_after_its_silence",
        f"{T}::test_a_backup_is_due_after_its_wait_or_at_once_when_only_the_positions_behind_are_missing",
        f"{T}::test_a_loop_the_shards_went_past_goes_on_beside_the_others",
    ],
    "network partition": [
        f"{M}::test_a_frozen_member_is_out_once_the_view_drops_it_after_its_silence",
        f"{W}::test_a_silent_role_holder_is_silent_only_while_a_heard_standby_can_take_its_role",
    ],
    "straggler": [
        f"{T}::test_a_backup_waits_a_few_of_the_shards_recent_steps_and_longer_before_it_knows_them",
        f"{T}::test_the_members_that_pushed_split_the_missing_batch_ids_and_every_one_is_trained_once",
        "test_straggler_window::"
        "test_a_straggler_computing_on_moved_parameters_is_not_summed_where_a_backup_was_asked_for",
    ],
    "a data server's static worker SIGKILL": [
        f"{M}::test_a_data_servers_static_worker_lost_promotes_a_standby",
        f"{M}::test_a_lost_data_server_with_its_replica_on_a_live_peer_comes_back_from_it",
        f"{F}::test_a_lost_data_server_suspends_training_until_a_standby_holds_it",
    ],
    "the coordinator's static worker SIGKILL": [
        f"{M}::test_the_coordinators_worker_lost_rebuilds_it_first",
        f"{R}::test_shards_at_one_version_go_on_from_there_with_the_steps_the_copy_lacked",
        f"{R}::test_a_shard_lost_with_the_coordinator_waits_at_the_snapshot_its_peer_holds",
    ],
    "a shard lost with its replica": [
        f"{M}::test_a_shard_lost_with_its_replica_goes_back_to_the_checkpoint_after_asking",
        f"{M}::test_without_peer_replicas_a_lost_shard_past_the_start_goes_back_to_the_checkpoint",
        f"{R}::test_a_shard_lost_without_its_replica_cannot_be_rebuilt",
    ],
    "a static worker retired, or SIGTERMed": [
        f"{M}::test_retire_hands_over_or_waits_when_no_standby_can_take_its_data_servers",
        f"{W}::test_the_static_workers_watch_is_told_what_happened_and_says_it_back",
    ],
    "a static worker SIGKILLed in the middle of its own hand-over": [
        f"{M}::test_a_data_servers_static_worker_lost_promotes_a_standby",
        f"{M}::test_the_coordinators_worker_lost_rebuilds_it_first",
    ],
    "the standby chosen for a lost data server SIGKILLed": [
        f"{M}::test_the_next_round_of_a_promotion_has_the_arguments_of_the_old_recursion",
        f"{B}::test_a_lone_standby_silent_for_a_moment_is_waited_for",
    ],
    "a loss reported after the promotion it caused": [
        f"{M}::test_a_loss_the_coordinator_reported_promotes_once_whatever_else_is_lost",
    ],
    "a closing cluster's stale process group": "the harness's process groups, not the engine's membership",
    "no standby left": [f"{M}::test_no_standby_waits_then_fails"],
    "a model that fails on one worker": [
        f"{F}::test_a_worker_whose_model_failed_is_excluded_and_the_next_check_takes_its_share",
        f"{F}::test_the_same_batch_failing_on_two_workers_fails_the_job_naming_both",
    ],
    "the Dask scheduler SIGKILL": ["test_errors::test_with_the_scheduler_gone_whatever_failed_is_its_loss"],
    "the controller (flow process) SIGKILL": "the job ends with its controller; a new run resumes from a "
    "checkpoint (no membership decision: tests/test_flow.py)",
    "SLURM": [
        f"{M}::test_a_compute_worker_lost_is_a_check_once_the_members_left_answered",
        f"{M}::test_a_graceful_leave_is_checked_like_any_change",
    ],
    "a container `docker kill`ed": [
        f"{M}::test_a_compute_worker_lost_is_a_check_once_the_members_left_answered"
    ],
    "traffic from outside the cluster": "refused by TLS before any message is read (tests/test_tls.py)",
    "a static worker SIGKILLed while the job starts": "nothing is trained before every server stands: the "
    "start is tried again (tests/test_user_cluster.py)",
    "a data server's static worker frozen longer than": [
        f"{W}::test_a_silent_role_holder_is_silent_only_while_a_heard_standby_can_take_its_role",
        f"{M}::test_a_data_servers_static_worker_lost_promotes_a_standby",
    ],
    "a static worker starved of CPU": [
        f"{W}::test_an_answer_to_a_direct_call_counts_as_a_heartbeat",
        f"{B}::test_a_lone_standby_silent_for_a_moment_is_waited_for",
    ],
    "a compute member starved of CPU": [
        f"{M}::test_a_starving_member_that_answers_the_handshake_is_kept",
        f"{W}::test_a_silent_member_that_answered_a_direct_call_lately_is_still_live",
    ],
    "no fault, on a cluster of plain `dask worker`": [
        f"{S}::test_first_members_are_admitted_not_rolled_back",
        f"{W}::test_live_members_are_running_heard_and_loaded_elastic_workers",
    ],
    "a checkpoint write that fails": "a write to storage, not a membership change "
    "(tests/test_checkpoint_failures.py)",
    "more than `checkpoint_failures_allowed`": "a write to storage, not a membership change "
    "(tests/test_checkpoint_failures.py)",
    "a coordinator rebuilt after a promotion": [
        f"{R}::test_the_copy_follows_the_record_part_by_part_and_through_a_rollback",
    ],
    "the controller SIGKILLed or frozen, seen from the cluster": "the registry's lease on the job id, not a "
    "membership change (tests/test_registry.py)",
    "`cluster_class=": "how a cluster is started, not a membership change (tests/test_slurm.py)",
    "the Prefect server SIGKILLed": "reports wait in a backlog; training is not touched "
    "(tests/test_prefect_outage.py)",
    "the Prefect server gone for good": "reports are dropped after their backlog; training is not touched "
    "(tests/test_prefect_outage.py)",
    "**all of the above at once**": "the chaos soak: each of its faults is one of the rows above",
}


def faults_rows() -> list[str]:
    """The first cell of every row of the page's first table (the faults)."""
    lines = FAULTS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| fault |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


def test_every_fault_the_page_lists_is_decided_by_a_unit_test_or_says_why_not() -> None:
    rows = faults_rows()
    assert len(rows) > 30, rows  # (the table is found)
    unmatched = [row for row in rows if not any(row.startswith(key) for key in DECIDED)]
    assert not unmatched, f"say which unit tests decide these faults, or why none: {unmatched}"
    stale = [key for key in DECIDED if not any(row.startswith(key) for row in rows)]
    assert not stale, f"no longer rows of docs/faults.md: {stale}"


def test_every_unit_test_named_exists() -> None:
    here = Path(__file__).parent
    missing = []
    for named in DECIDED.values():
        for entry in named if isinstance(named, list) else []:
            module, _, test = entry.partition("::")
            tree = ast.parse((here / f"{module}.py").read_text())
            if test not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
                missing.append(entry)
    assert not missing, missing


def test_a_reason_names_where_the_fault_is_tested_on_real_processes() -> None:
    reasons = [why for why in DECIDED.values() if isinstance(why, str)]
    assert reasons and all(re.search(r"tests/test_\w+\.py|rows above|harness", why) for why in reasons)
