"""`gcs-spawner down RUN`: delete exactly what `up` (and `keep`) made, as the run's record lists it, and nothing
else: the job, the tasks, the outputs, the markers and the record itself stay in the queue.

Kinds go in the record's order (gcs_spawner/record.py, KINDS): the groups (their VMs go with them), then the
templates they used, then TPU queued resources (with force, taking their nodes), then plain TPU nodes; within a
kind, every resource at once. A 404 is a resource already gone (deleted by hand, by a machine deleting itself, or
never made because `up` was interrupted before its create). Each one gone is marked `deleted` in the record, so a
second `down` sends nothing. A job that is not complete (reporting.status's `complete`, the completion rule the
status page shows) is deleted only when the user says so (`confirm`, or `yes`).

Callers other than the command (tests, the fleet rehearsal) call `down(open_store(run.queue), yes=True)`, with
the endpoints from FLEET_COMPUTE_ENDPOINT / FLEET_TPU_ENDPOINT or `clients` passed in, as `up.up` takes them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import TextIO

from gcs_spawner.record import KINDS, Recorded, Resource, RunRecord
from gcs_spawner.up import Clients, Declined

log = logging.getLogger("gcs_spawner")


class DownError(Exception):
    """Some deletes failed; the message names each (run down again once the cause is fixed)."""


@dataclasses.dataclass
class DownReport:
    deleted: list[str] = dataclasses.field(default_factory=list)  # sent now and answered
    gone: list[str] = dataclasses.field(default_factory=list)  # 404: already gone
    skipped: list[str] = dataclasses.field(default_factory=list)  # marked deleted by an earlier down
    would: list[str] = dataclasses.field(default_factory=list)


def delete_request(resource: Resource):
    """The request that deletes `resource` (fleet/compute.py and fleet/tpu.py build it)."""
    if resource.kind == "instance_group":
        from fleet import compute

        return compute.delete_group(resource.project, resource.name, zone=resource.zone, region=resource.region)
    if resource.kind == "instance_template":
        from fleet import compute

        return compute.delete_template(resource.project, resource.name)
    from fleet import tpu

    collection = "queuedResources" if resource.kind == "queued_resource" else "nodes"
    name = f"{tpu.location(resource.project, resource.zone)}/{collection}/{resource.name}"
    return tpu.delete_queued_resource(name) if resource.kind == "queued_resource" else tpu.delete_node(name)


def down(store, *, dry_run: bool = False, yes: bool = False, out: TextIO | None = None,
         confirm: Callable[[str], bool] | None = None, clients: Clients | None = None, parallel: int = 8) -> DownReport:
    """Delete the resources the queue `store`'s run record lists (see the module docstring)."""
    from google.api_core import exceptions as api_exceptions

    from fleet import gapi

    out = out or sys.stdout
    clients = clients or Clients()
    record = RunRecord(store)
    report = DownReport()
    listed = record.resources()
    live = [r for r in listed if r.state != "deleted"]
    report.skipped = [r.resource.describe() for r in listed if r.state == "deleted"]
    if not live:
        print(f"down: nothing to delete: {store.url('run/resources/')} lists "
              f"{len(listed)} resources, all deleted already" if listed else
              f"down: {store.url('run/')} records no resources (was `up` run on this queue?)", file=out)
        return report
    if not dry_run and not yes:
        _confirm_incomplete(store, live, confirm)
    for kind in KINDS:
        batch = [r for r in live if r.resource.kind == kind]
        if not batch:
            continue
        if dry_run:
            for recorded in batch:
                line = f"send {gapi.request_line(delete_request(recorded.resource))}"
                report.would.append(line)
                print(f"would {line}", file=out)
            continue
        client = clients.compute_clients() if kind in ("instance_group", "instance_template") else clients.tpu_clients()

        def one(recorded: Recorded) -> tuple[Recorded, str]:
            try:
                client.send(delete_request(recorded.resource))
            except api_exceptions.NotFound:
                return recorded, "gone"
            record.deleted(recorded.resource)
            return recorded, "deleted"

        failures = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(parallel, len(batch)))) as pool:
            futures = [pool.submit(one, r) for r in batch]
            for future in concurrent.futures.as_completed(futures):
                try:
                    recorded, outcome = future.result()
                except gapi.API_ERRORS as err:
                    failures.append(str(err))
                    continue
                if outcome == "gone":
                    record.deleted(recorded.resource)
                    report.gone.append(recorded.resource.describe())
                else:
                    report.deleted.append(recorded.resource.describe())
                log.info("event=%s resource=%s", outcome, recorded.resource.describe())
        if failures:
            raise DownError(f"{len(failures)} of {len(batch)} {kind} deletes failed (run down again once fixed; the "
                            "rest is deleted or marked):\n  " + "\n  ".join(sorted(failures)))
    if dry_run:
        print(f"dry run: {len(report.would)} calls shown, none made", file=out)
    else:
        print(f"down: {len(report.deleted)} deleted, {len(report.gone)} already gone; the queue's data stays at "
              f"{store.root_url}", file=out)
    return report


def _confirm_incomplete(store, live: list[Recorded], confirm: Callable[[str], bool] | None) -> None:
    """Ask before deleting the machines of a job that is not complete (reporting.status.snapshot's `complete`),
    or that finished with dead letters (its outputs miss them)."""
    from reporting import status

    view = status.snapshot(store)
    if view["complete"] and not view["failed"]:
        return
    state = "finished with dead letters" if view["complete"] else "not complete"
    question = (f"the job is {state} ({view['done']} of {view['total']} tasks done, {view['failed']} failed); "
                f"delete its {len(live)} resources anyway? [y/N] ")
    if confirm is None:
        raise Declined(f"{question.split(';')[0]}: down asks first, and stdin is not a terminal: pass --yes")
    if not confirm(question):
        raise Declined("not confirmed; nothing was deleted")
