"""`up`'s machines step: make the cloud what the run file says, by the difference `up` printed and the user
accepted (gcs_spawner/converge.py).

- A replace deletes the run's old resources first (gcs_spawner/cloud.py, `delete_all`; each marked `deleted` in
  the record), then makes the new ones as a first `up` would.
- VM: the instance template, then the managed instance group (NAME, in its zone or region); a count change
  resizes the group (instanceGroupManagers.resize).
- TPU on queued resources: the count's extras are deleted (the highest numbers), then the keeper's own step
  (fleet/keeper.py: it lists what exists and adds only what the claimable work needs, up to the count). Plain
  TPU nodes: the extras deleted, then NAME-NNNN made up to the count.

Each create is recorded first (write-ahead, gcs_spawner/record.py) and a 409 on a resource the record holds is
taken as done; each delete is marked in the record once the API answered. With `dry_run`, one line per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from exitcodes import EX_FAILED
from fleet import specs
from gcs_spawner import checks
from gcs_spawner.cloud import Clients, delete_all, delete_request
from gcs_spawner.converge import Difference
from gcs_spawner.record import Resource, RunRecord
from gcs_spawner.runfile import Run

log = logging.getLogger("gcs_spawner")


class UpError(Exception):
    """A step failed for a reason other than bad input (the API or the store refused); the message says which."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


class FleetStep:
    """The machines step of one `up` (see the module docstring); `report` is up.UpReport."""

    def __init__(self, run: Run, project: str, record: RunRecord, clients: Clients, report, dry_run: bool,
                 would: Callable[[str], None], tasks: int, work, say: Callable[[str], None] = lambda line: None):
        self.run, self.project, self.record, self.clients = run, project, record, clients
        self.report, self.dry_run, self.would, self.tasks, self.work = report, dry_run, would, tasks, work
        self.say = say  # one line per resource made, resized or deleted: what a terminal shows of this step

    def apply(self, diff: Difference) -> None:
        launch = specs.Launch.make(self.run.spec, self.run.queue, self.run.fields.code.url)
        if diff.replace:
            self._delete([f.resource for f in diff.found])
        elif diff.delete_tpus:
            self._delete([f.resource for f in diff.delete_tpus])
        if self.run.kind == "vm":
            self.vm_fleet(launch, None if diff.replace else diff.resize_to)
        elif self.run.spec.use_queued_resources:
            self._queued_resources(launch)
        else:
            self._tpu_nodes(launch)

    def _delete(self, resources: list[Resource]) -> None:
        from fleet import gapi

        if self.dry_run:
            for resource in resources:
                self.would(f"send {gapi.request_line(delete_request(resource))}")
            return
        for resource, outcome in delete_all(self.clients, resources).items():
            self.record.deleted(resource)
            self.report.deleted.append(resource.describe())
            self.say(f"machines: deleted {resource.describe()}" + (" (gone already)" if outcome == "gone" else ""))

    def create(self, resource: Resource, request, exists: Callable[[], bool], send: Callable[[object], None]) -> None:
        """Create `resource` with `request` unless this run already made it (see record.py's contract)."""
        from google.api_core import exceptions as api_exceptions

        from fleet import gapi

        if self.dry_run:
            if not (exists() and self.record.is_ours(resource)):  # what this run made already needs no call
                self.would(f"send {gapi.request_line(request)}")
            return
        ours = self.record.is_ours(resource)
        if exists():
            if not ours:
                raise checks.CheckError(f"{resource.describe()} exists in project {resource.project} and was not "
                                        f"made by run {self.run.name!r}; delete it, or rename the run")
            self.report.existed.append(resource.describe())
            self.record.created(resource)
            return
        self.record.intend(resource)
        try:
            send(request)
        except api_exceptions.Conflict:
            if not ours:
                self.record.store.delete(resource.object)
                raise checks.CheckError(f"{resource.describe()} was made by someone else while this run asked for it; "
                                        "rename the run") from None
            self.report.existed.append(resource.describe())
        except gapi.API_ERRORS as err:
            raise UpError(f"{type(request).__name__} {resource.describe()}: {err} (fix the cause and run up again: "
                          "what was made is recorded, and down deletes it)") from None
        else:
            self.report.created.append(resource.describe())
            self.say(f"machines: created {resource.describe()}")
            log.info("event=created resource=%s", resource.describe())
        self.record.created(resource)

    def vm_fleet(self, launch, resize_to: int | None) -> None:
        from fleet import compute, gapi

        fleet, project, name = self.run.fields.fleet, self.project, self.run.name
        (template, template_exists), (group, group_exists) = vm_resources(self.run, project, self.clients)
        send = (lambda r: self.clients.compute_clients().send(r))
        request = compute.insert_template(project, specs.instance_template(self.run.spec, launch, name))
        self.create(template, request, template_exists, send)
        size = min(fleet.count, max(1, self.tasks))
        request = compute.insert_group(project, name, name, size, zone=group.zone, region=fleet.region,
                                       on_failure=fleet.on_failure.upper().replace("-", "_"))
        self.create(group, request, group_exists, send)
        if resize_to is None or group.describe() in self.report.created:
            return
        request = compute.resize_group(project, name, resize_to, zone=group.zone, region=fleet.region)
        if self.dry_run:
            self.would(f"send {gapi.request_line(request)}")
            return
        try:
            send(request)
        except gapi.API_ERRORS as err:
            raise UpError(f"resizing {group.describe()} to {resize_to}: {err} (fix the cause and run up again)") from None
        self.report.resized.append(f"{group.describe()} to {resize_to}")
        self.say(f"machines: resized {group.describe()} to {resize_to}")
        log.info("event=resized resource=%s size=%d", group.describe(), resize_to)

    def _queued_resources(self, launch) -> None:
        """The keeper's step makes them: it lists the run's queued resources in every zone and adds only what the
        claimable work needs, up to the count (fleet/keeper.py), recording each before it is sent."""
        from fleet import keeper

        fleet_keeper = keeper.Keeper(
            self.clients.tpu_clients(), self.run.spec, launch, self.project, list(self.run.fields.fleet.zones),
            self.run.machines, self.work, dry_run=self.dry_run, before_create=self._record_queued)
        report = fleet_keeper.step()
        if self.dry_run:  # the keeper printed a line per create (gapi.print_dry_run)
            self.report.would += [f"send CreateQueuedResourceRequest {c}" for c in report.created]
            return
        for created in report.created:
            zone, rid = created.split("/", 1)
            self.record.created(Resource("queued_resource", self.project, rid, zone=zone))
            self.report.created.append(f"queued_resource {rid} ({zone})")
            self.say(f"machines: created queued_resource {rid} ({zone})")
        self.report.existed += [f"queued_resource {rid}" for rid in report.alive]
        if report.refused and not report.created and not report.alive:
            raise UpError(f"every zone refused the queued resources: {'; '.join(report.refused[:3])}")

    def _record_queued(self, zone: str, rid: str) -> None:
        self.record.intend(Resource("queued_resource", self.project, rid, zone=zone))

    def _tpu_nodes(self, launch) -> None:
        from google.api_core import exceptions as api_exceptions

        from fleet import launch as launching
        from fleet import tpu

        zone = self.run.fields.fleet.zones[0]
        clients = self.clients.tpu_clients()
        for node_id in launching.tpu_names(self.run.name, min(self.run.machines, max(1, self.tasks))):
            def exists(node_id=node_id) -> bool:
                try:
                    clients.get_node(f"{tpu.location(self.project, zone)}/nodes/{node_id}")
                    return True
                except api_exceptions.NotFound:
                    return False
            request = tpu.create_node(self.project, zone, node_id, specs.tpu_node(self.run.spec, launch))
            self.create(Resource("tpu_node", self.project, node_id, zone=zone), request, exists,
                         lambda r: clients.send(r))


def vm_resources(run: Run, project: str, clients: Clients):
    """(resource, exists) for the run's instance template and group."""
    from google.api_core import exceptions as api_exceptions

    fleet, name = run.fields.fleet, run.name
    zone = fleet.zones[0] if fleet.zones else None

    def probe(get: Callable[[], object]) -> Callable[[], bool]:
        def exists() -> bool:
            try:
                get()
                return True
            except api_exceptions.NotFound:
                return False
        return exists

    compute = clients.compute_clients
    template = Resource("instance_template", project, name)
    group = Resource("instance_group", project, name, zone=zone, region=fleet.region)

    def get_group() -> object:
        if zone:
            return compute().zonal_groups.get(project=project, zone=zone, instance_group_manager=name)
        return compute().regional_groups.get(project=project, region=fleet.region, instance_group_manager=name)

    return [(template, probe(lambda: compute().templates.get(project=project, instance_template=name))),
            (group, probe(get_group))]
