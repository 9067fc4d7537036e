"""How often the controller looks: at progress, at the scheduler's view of the workers, and how long it
waits for a group of joins or losses to be whole."""

# How often the controller polls progress between survival checks; bounds how late a fault schedule or a
# progress callback sees a step. Each poll is a call to the coordinator, and on a machine whose cores the
# compute workers share every background call slows them (measured: 5 to 10% on a 20 ms step with 2
# cores), so the fast poll is only for runs that act on steps (a fault schedule, a progress callback).
PROGRESS_POLL_SECONDS = 0.02
PROGRESS_POLL_IDLE_SECONDS = 0.1
# How often the controller publishes its progress to the scheduler's metadata (see `read_progress`).
PUBLISH_SECONDS = 0.2
# A worker registers with the scheduler while its status is still "init" and reports "running" a message
# later, so the check its add-worker event triggers may not count it yet. `AnnounceRunning` wakes the
# controller when it turns "running"; in case that event is missed, the controller looks at the membership
# again this soon instead of a liveness interval later.
STARTING_RECHECK_SECONDS = 0.05
# How often the controller reads the scheduler's view of the workers between survival checks: a worker
# that froze (SIGSTOP, a hung device) stops sending heartbeats, and this is how soon that is seen.
MEMBERSHIP_POLL_SECONDS = 0.25
# Workers lost within this long of the first are one membership change (`membership.wait_for_losses`): the
# scheduler removes workers killed together a few milliseconds apart. Waited only while a member still
# listed does not answer a connection (it may be dying too).
LOSS_GROUP_SECONDS = 0.05
