"""React to a lost worker with a Prefect automation: every `prefect-elastic.worker.lost` event runs the
flow `worker-lost-notice` with the job and the worker it names.

    python on_worker_lost.py serve     # registers the deployment worker-lost-notice/on-worker-lost and runs
                                       # its flow runs in this process until interrupted
    python on_worker_lost.py create    # creates the automation (once; run it while `serve` is up)

The flow here only logs a line; put your notification in it (a Slack or e-mail block, a ticket, a page), or
make the automation run any other deployment (scale the cluster up, start a flow that inspects the node).
"""

from __future__ import annotations

import argparse
import sys
from uuid import UUID

from prefect import flow, get_client
from prefect.automations import Automation, EventTrigger, Posture, RunDeployment

FLOW_NAME = "worker-lost-notice"
DEPLOYMENT_NAME = "on-worker-lost"
AUTOMATION_NAME = "prefect-elastic: a notice for every lost worker"


@flow(name=FLOW_NAME, log_prints=True)
def worker_lost_notice(job: str, worker: str, step: str = "", reason: str = "") -> str:
    message = f"prefect-elastic job {job} lost worker {worker} at step {step}: {reason}"
    print(message)
    return message


def _from_event(template: str) -> dict[str, str]:
    # A parameter filled in from the event that fired the automation. Prefect renders it with Jinja, to a
    # string: the flow's parameters are strings (an `int` parameter would refuse "3").
    return {"__prefect_kind": "jinja", "template": template}


def create_automation(deployment: str = f"{FLOW_NAME}/{DEPLOYMENT_NAME}") -> UUID:
    """Create the automation that runs `deployment` for every lost worker of any prefect-elastic job."""
    with get_client(sync_client=True) as client:
        deployment_id = client.read_deployment_by_name(deployment).id
    automation = Automation(
        name=AUTOMATION_NAME,
        trigger=EventTrigger(
            expect={"prefect-elastic.worker.lost"},
            match={"prefect.resource.id": "prefect-elastic.job.*"},
            # One run per event: reactive, threshold 1, and a run per job resource.
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        ),
        actions=[
            RunDeployment(
                source="selected",
                deployment_id=deployment_id,
                parameters={
                    "job": _from_event("{{ event.resource.name }}"),
                    "worker": _from_event("{{ event.payload.worker }}"),
                    "step": _from_event("{{ event.payload.step }}"),
                    "reason": _from_event("{{ event.payload.reason }}"),
                },
            )
        ],
    )
    created = automation.create()
    print(f"automation {created.id}: {AUTOMATION_NAME}")
    return created.id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve", "create"])
    args = parser.parse_args(argv)
    if args.command == "serve":
        worker_lost_notice.serve(name=DEPLOYMENT_NAME)
    else:
        create_automation()
    return 0


if __name__ == "__main__":
    sys.exit(main())
