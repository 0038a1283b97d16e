"""`gcs-spawner keep RUN`: the one keeper of a run. Each step it

1. deletes the run's machines that the bucket has given up on while the cloud still has them (`lost`: a worker
   killed hard, a machine stuck in its boot; reporting.machinestate) - VMs through their group (deleteInstances,
   so the group does not make them again), TPU VMs by their queued resource or node - and writes why in the
   machine's deletion note (fleet/machines.py, `note_deleted`), so that nothing bills unseen;
2. for a TPU run on queued resources, keeps them alive while the queue has claimable work (fleet/keeper.py),
   recording each replacement before it is sent, so that `down` deletes it too. At the run's `max_dollars` (the
   fleet's cost so far, reporting/cost.py) it makes no more machines; those alive finish their tasks.

`up` and `down` never import this module; `up --keep` calls it from the command.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from gcs_spawner.cloud import Clients, resolve_project
from gcs_spawner.record import Resource, RunRecord
from gcs_spawner.runfile import Run

log = logging.getLogger("gcs_spawner")


def queue_work(store):
    """What the keeper asks the queue each step (reporting.status.snapshot: a few listings per region): claimable =
    never claimed, released, or under a lease silent past its TTL; held = under a live lease; complete = status's
    completion rule (taskqueue/completion.py), the only thing that stops the keeper."""
    from fleet import keeper
    from reporting import status

    def work() -> keeper.Work:
        view = status.snapshot(store)
        return keeper.Work(claimable=view["pending"] + view["stale"], held=view["leased"], complete=view["complete"])

    return work


def run_prices(store, table):
    """The price table `table` (reporting.pricing.PriceTable) with the prices the user gave `up` for types it does
    not price (run/run.json's `prices`: $ per machine-hour, what the run pays, spot or not), so that status and the
    keeper's spending limit price those machines too."""
    import dataclasses

    from gcs_spawner.record import RunRecord
    from objectstore import StoreError

    try:
        given = (RunRecord(store).read_run() or {}).get("prices") or {}
    except (StoreError, ValueError):  # no record to read: the table as it is
        return table
    if not given:
        return table
    entries = {name: {"on_demand_per_hour": float(p), "spot_per_hour": float(p)} for name, p in given.items()
               if not table.priced(name)}
    return dataclasses.replace(table, cpu_machines={**table.cpu_machines, **entries})


def spent_dollars(store, prices: str | None = None) -> float:
    """What the run's machines have cost so far, from their records (reporting.fleetview, reporting.cost), priced
    with the run's given prices too (`run_prices`)."""
    from reporting.fleetview import fleet_snapshot
    from reporting.pricing import load_prices

    return fleet_snapshot(store, prices=run_prices(store, load_prices(prices)))["cost"]["total_dollars"]


@dataclasses.dataclass
class LostReport:
    deleted: list[str] = dataclasses.field(default_factory=list)  # lost machines the cloud still had, now deleted
    gone: list[str] = dataclasses.field(default_factory=list)  # lost machines the cloud no longer has
    would: list[str] = dataclasses.field(default_factory=list)


def lost_machines(store) -> list[dict]:
    """The machine records the bucket has given up on (condition `lost`, reporting.machinestate), newest view."""
    from reporting.fleetview import fleet_snapshot

    return [row for row in fleet_snapshot(store)["roster"] if row["condition"] == "lost"]


def delete_lost(run: Run, project: str, store, clients: Clients, dry_run: bool = False) -> LostReport:
    """Delete the run's lost machines that the cloud still has (step 1 of the module docstring)."""
    from google.api_core import exceptions as api_exceptions

    from fleet import compute, gapi
    from fleet.machines import note_deleted
    from gcs_spawner import cloud

    report = LostReport()
    lost = lost_machines(store)
    if not lost:
        return report
    # Every machine of the run: the run file's fleet and what `gcs-spawner add` made beside it (its zones are in
    # the record: cloud.identity), VM group members and TPU VMs alike.
    # A TPU run lists only the TPU API unless it has an added VM group (a project may not enable Compute).
    record = RunRecord(store)
    who = cloud.identity(record, run.fields, project)
    kinds = {run.kind, *(a.get("kind") for a in ((record.read_run() or {}).get("added") or {}).values())}
    found = cloud.find_run(clients, project, run.name, run.kind if len(kinds) == 1 else None, who.zones, who.regions)
    requests = {}  # machine -> (the delete request, the API that takes it)
    for f in found:
        if f.resource.kind == "instance_group":
            group = f.resource
            for member in cloud.group_members(clients, group):
                ref = compute.GroupRef("zones" if group.zone else "regions", group.where, group.name)
                requests[member.name] = (compute.remove_group_member(project, ref, member.zone, member.name), "vm")
        elif f.resource.kind in ("queued_resource", "tpu_node"):
            requests[f.resource.name] = (cloud.delete_request(f.resource), "tpu")
    for row in lost:
        machine = row["machine"]
        request, api = requests.get(machine, (None, None))
        if request is None:
            report.gone.append(machine)
            continue
        if dry_run:
            report.would.append(f"send {gapi.request_line(request)}")
            print(f"would {report.would[-1]}")
            continue
        reason = (f"lost: its last record was {row['age_s']:.0f} s old, past the silence after which status gives "
                  "a machine up, while the cloud still had it")
        client = clients.compute_clients() if api == "vm" else clients.tpu_clients()
        try:
            client.send(request)
        except api_exceptions.NotFound:
            report.gone.append(machine)
            continue
        note_deleted(store, machine, "gcs-spawner keep", reason)
        report.deleted.append(machine)
        log.warning("event=lost_machine_deleted run=%s machine=%s", run.name, machine)
    return report


def keep(run: Run, *, project: str | None = None, interval_s: float = 60.0, once: bool = False, dry_run: bool = False,
         clients: Clients | None = None, prices: str | None = None, sleep: Callable[[float], None] = time.sleep,
         out=None):
    """Keep the run (the module docstring): every `interval_s`, delete lost machines the cloud still has, and for a
    TPU run on queued resources, step the keeper; until the queue is complete, or once. Returns (the last keeper
    report or None, the lost machines' report summed over the steps)."""
    from fleet import keeper, specs
    from objectstore import open_store

    project = resolve_project(run.file, project or run.fields.project)
    clients = clients or Clients()
    store = open_store(run.queue)
    record = RunRecord(store)
    queue = queue_work(store)
    limit = run.fields.max_dollars
    lost = LostReport()

    def work() -> keeper.Work:
        left = queue()
        if limit is not None and left.claimable:
            spent = spent_dollars(store, prices)
            if spent >= limit:
                log.warning("event=budget_reached run=%s spent=%.2f max_dollars=%.2f action=no_new_machines",
                            run.name, spent, limit)
                return keeper.Work(claimable=0, held=left.held, complete=left.complete)
        return left

    def before_create(zone: str, rid: str) -> None:
        record.intend(Resource("queued_resource", project, rid, zone=zone))

    fleet_keeper = None
    if run.kind == "tpu" and run.spec.use_queued_resources:
        launch = specs.Launch.make(run.spec, run.queue, run.fields.code.url)
        fleet_keeper = keeper.Keeper(clients.tpu_clients(), run.spec, launch, project, list(run.fields.fleet.zones),
                                     run.machines, work, dry_run=dry_run, before_create=before_create)
    steps = 0
    while True:
        step = delete_lost(run, project, store, clients, dry_run)
        lost.deleted += step.deleted
        lost.would += step.would
        lost.gone = step.gone
        report = fleet_keeper.step() if fleet_keeper is not None else None
        if report is not None:
            for created in report.created:
                zone, rid = created.split("/", 1)
                record.created(Resource("queued_resource", project, rid, zone=zone))
        steps += 1
        finished = report.drained if report is not None else queue().complete
        if once or finished:
            return report, lost
        sleep(interval_s)
