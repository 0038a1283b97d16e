"""`gcs-spawner down RUN`: delete what `up` (and `keep`) made, as the run's record lists it and as the cloud lists it
under the run's label, and nothing else: the job, the tasks, the outputs, the markers and the record itself stay.

The record (gcs_spawner/record.py) is what `up` asked for; the label (`spawn-run: NAME`, gcs_spawner/cloud.py) is
what the cloud holds. `down` deletes both, so an edited run file (another queue, zone or count) or a lost one
(`down QUEUE`: the record names the run, its project and zones) still deletes everything, and it says what it
found beyond the record. A resource found beyond the record is marked `deleted` in the record of the queue its
machines were told, when that queue records it.

Kinds go in the record's order (KINDS): the groups (their VMs go with them), then the templates they used, then
TPU queued resources (with force, taking their nodes), then plain TPU nodes; within a kind, every resource at once.
A 404 is a resource already gone (deleted by hand, by a machine deleting itself, or never made because `up` was
interrupted before its create). Each one gone is marked `deleted` in the record, so a second `down` sends nothing.
A job that is not complete (reporting.status's `complete`) is deleted only when the user says so (`confirm`, or
`yes`).

Callers other than the command (tests, the fleet rehearsal) call `down(open_store(run.queue), yes=True)`, with
the endpoints from FLEET_COMPUTE_ENDPOINT / FLEET_TPU_ENDPOINT or `clients` passed in, as `up.up` takes them.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import TextIO

from gcs_spawner.cloud import Clients, Declined, DeleteError, Found, delete_all, delete_request, find_run, identity
from gcs_spawner.record import KINDS, Resource, RunRecord

log = logging.getLogger("gcs_spawner")


DownError = DeleteError  # some deletes failed (exit 1); the message names each


@dataclasses.dataclass
class DownReport:
    deleted: list[str] = dataclasses.field(default_factory=list)  # sent now and answered
    gone: list[str] = dataclasses.field(default_factory=list)  # 404: already gone
    skipped: list[str] = dataclasses.field(default_factory=list)  # marked deleted by an earlier down
    would: list[str] = dataclasses.field(default_factory=list)
    beyond: list[str] = dataclasses.field(default_factory=list)  # found by the label, not in the record


def down(store, *, dry_run: bool = False, yes: bool = False, out: TextIO | None = None,
         confirm: Callable[[str], bool] | None = None, clients: Clients | None = None, parallel: int = 8,
         run=None, project: str | None = None) -> DownReport:
    """Delete the resources the queue `store`'s run record lists, and those the cloud lists under the run's label
    (`run`: the run file's fields, runfile.RunFile, when the command was given one; see the module docstring)."""
    from fleet import gapi

    out = out or sys.stdout
    clients = clients or Clients()
    record = RunRecord(store)
    report = DownReport()
    listed = record.resources()
    live = [r for r in listed if r.state != "deleted"]
    report.skipped = [r.resource.describe() for r in listed if r.state == "deleted"]
    who = identity(record, run, project)
    beyond: list[Found] = []
    if who is not None:
        known = {r.resource for r in live}
        beyond = [f for f in find_run(clients, who.project, who.name, None, who.zones, who.regions)
                  if f.resource not in known]
    if beyond:
        report.beyond = [f.resource.describe() for f in beyond]
        print(f"down: found {len(beyond)} resources of run {who.name!r} beyond the record of {store.root_url} "
              f"(by the label spawn-run={who.name}): " + ", ".join(report.beyond), file=out)
    if not live and not beyond:
        print(f"down: nothing to delete: {store.url('run/resources/')} lists "
              f"{len(listed)} resources, all deleted already" if listed else
              f"down: {store.url('run/')} records no resources (was `up` run on this queue?)"
              + (f", and the cloud lists none labelled spawn-run={who.name} in project {who.project}" if who else ""),
              file=out)
        return report
    if not dry_run and not yes:
        _confirm_incomplete(store, len(live) + len(beyond), confirm)
    targets = sorted([*(r.resource for r in live), *(f.resource for f in beyond)],
                     key=lambda r: (KINDS.index(r.kind), r.where, r.name))
    if dry_run:
        for resource in targets:
            line = f"send {gapi.request_line(delete_request(resource))}"
            report.would.append(line)
            print(f"would {line}", file=out)
        print(f"dry run: {len(report.would)} calls shown, none made", file=out)
        return report
    elsewhere = {f.resource: f.queue for f in beyond}
    try:
        outcomes = delete_all(clients, targets, parallel)
    except DeleteError as err:
        _mark(record, getattr(err, "outcomes", {}), elsewhere, report)
        raise
    _mark(record, outcomes, elsewhere, report)
    if any(r.kind != "instance_template" and outcomes.get(r) == "deleted" for r in targets):
        _note_machines(store)
    print(f"down: {len(report.deleted)} deleted, {len(report.gone)} already gone; the queue's data stays at "
          f"{store.root_url}", file=out)
    return report


def _note_machines(store) -> None:
    """Write a deletion note (fleet/machines.py) for each machine whose last record is not final: `down` deleted
    its group or TPU VM, so it will write no record again, and status must not show it up."""
    import concurrent.futures

    from fleet.machines import FINAL_STATES, PREFIX, note_deleted

    names = [e.name[len(PREFIX):-len(".json")] for e in store.list(PREFIX)
             if e.name.endswith(".json") and e.metadata.get("state") not in FINAL_STATES]
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda name: note_deleted(store, name, "gcs-spawner down", "its fleet was deleted"), names))
    log.info("event=machines_noted_deleted count=%d", len(names))


def _mark(record: RunRecord, outcomes: dict[Resource, str], elsewhere: dict[Resource, str | None],
          report: DownReport) -> None:
    """Mark each resource deleted in the record that lists it: this queue's, or (found by the label) the record
    of the queue its machines were told, when that one lists it."""
    from objectstore import StoreError, open_store

    for resource, outcome in outcomes.items():
        (report.gone if outcome == "gone" else report.deleted).append(resource.describe())
        if resource not in elsewhere:
            record.deleted(resource)
            continue
        queue = elsewhere[resource]
        try:
            other = RunRecord(open_store(queue)) if queue and queue != record.store.root_url else record
            if other.is_ours(resource):
                other.deleted(resource)
        except StoreError as err:
            log.warning("event=record_unmarked resource=%s queue=%s error=%s", resource.describe(), queue, err)


def _confirm_incomplete(store, count: int, confirm: Callable[[str], bool] | None) -> None:
    """Ask before deleting the machines of a job that is not complete (reporting.status.snapshot's `complete`),
    or that finished with dead letters (its outputs miss them)."""
    from reporting import status

    view = status.snapshot(store)
    if view["complete"] and not view["failed"]:
        return
    state = "finished with dead letters" if view["complete"] else "not complete"
    question = (f"the job is {state} ({view['done']} of {view['total']} tasks done, {view['failed']} failed); "
                f"delete its {count} resource{'s' if count != 1 else ''} anyway? [y/N] ")
    if confirm is None:
        raise Declined(f"{question.split(';')[0]}: down asks first, and stdin is not a terminal: pass --yes",
                       cannot_ask=True)
    if not confirm(question):
        raise Declined("not confirmed; nothing was deleted")
