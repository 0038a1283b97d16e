"""What `up`, `down`, `keep` and `status --cloud` share about the cloud: the clients they send through, the
declined question, the run's project, and the cloud's own view of a run, found by its label.

The label. Every resource a run makes carries `spawn-run: NAME` (gcs_spawner/runfile.py, RUN_LABEL) where the API
has labels:
- an instance template has no labels of its own; its `properties.labels` are the labels of every instance made
  from it (https://cloud.google.com/compute/docs/reference/rest/v1/instanceTemplates, InstanceProperties.labels;
  https://cloud.google.com/compute/docs/labeling-resources), so a template is the run's when its properties carry
  the label, and so is every VM of its group;
- a managed instance group has no labels field at all
  (https://cloud.google.com/compute/docs/reference/rest/v1/instanceGroupManagers): a group is the run's when it
  makes its instances from one of the run's templates (its `instanceTemplate`);
- a TPU VM carries them as Node.labels (https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.nodes);
  a queued resource has no labels of its own, and is the run's when the node it asks for does
  (QueuedResource.tpu.nodeSpec[].node.labels,
  https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.queuedResources).

`find_run(...)` lists those collections where the run may have made something (the zones and regions of its run file
and of its record) and keeps what carries the label: one list request per collection and place. Names alone are
not trusted: a resource named like the run but without its label is someone else's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from exitcodes import EX_FAILED
from gcs_spawner.record import Resource
from gcs_spawner.runfile import ADD_LABEL, RUN_LABEL

log = logging.getLogger("gcs_spawner")

#: Metadata key naming the queue on every template and TPU VM (fleet/specs.py, Launch.metadata).
QUEUE_KEY = "spawn-queue"


class Declined(Exception):
    """The user did not confirm (or could not be asked: no terminal and no --yes); `cannot_ask` says which."""

    def __init__(self, message: str, cannot_ask: bool = False):
        super().__init__(message)
        self.cannot_ask = cannot_ask


@dataclasses.dataclass
class Clients:
    """The Compute and TPU clients `up`, `down` and `keep` send through; made on first use from Application Default
    Credentials, or the FLEET_*_ENDPOINT overrides (fleet/gapi.py), unless passed in."""

    compute: object | None = None
    tpu: object | None = None

    def compute_clients(self):
        if self.compute is None:
            from fleet import compute

            self.compute = compute.ComputeClients.connect()
        return self.compute

    def tpu_clients(self):
        if self.tpu is None:
            from fleet import tpu

            self.tpu = tpu.TpuClients.connect()
        return self.tpu


def resolve_project(file, project: str | None) -> str:
    """The project given, else the default one (gcloud config); `file` names where to set it."""
    from fleet import gapi
    from gcs_spawner.checks import CheckError

    found = project or gapi.default_project()
    if not found:
        raise CheckError(f"{file}: project: none given and no default; set project in the run file, "
                         "or run 'gcloud config set project PROJECT'")
    return found


@dataclasses.dataclass(frozen=True)
class Found:
    """A resource of the run as the cloud lists it: `state` is the API's (a group: its target size as `size=N`),
    `queue` the queue its machines were told (from their metadata; None when the API shows none)."""

    resource: Resource
    state: str
    queue: str | None = None
    size: int | None = None
    template: str | None = None  # a group's instance template (its name)
    machine_type: str | None = None  # a template's machine type, a TPU's accelerator type
    added: str | None = None  # made by `gcs-spawner add` (its ADD_LABEL): not the run file's own fleet


def _metadata_items(items) -> dict[str, str]:
    return {item.key: item.value for item in items}


def _compute_lists(clients, project: str, name: str, zones: Iterable[str], regions: Iterable[str]) -> list[Found]:
    found = []
    ours: dict[str, str | None] = {}  # the run's templates, and the spec each was added from
    for template in clients.templates.list(project=project):
        props = template.properties
        if props.labels.get(RUN_LABEL) != name:
            continue
        ours[template.name] = props.labels.get(ADD_LABEL)
        found.append(Found(Resource("instance_template", project, template.name), "READY",
                           _metadata_items(props.metadata.items).get(QUEUE_KEY),
                           machine_type=props.machine_type.rsplit("/", 1)[-1], added=ours[template.name]))
    places = [("zone", z) for z in zones] + [("region", r) for r in regions]
    for scope, where in places:
        groups = (clients.zonal_groups.list(project=project, zone=where) if scope == "zone" else
                  clients.regional_groups.list(project=project, region=where))
        for group in groups:
            template = group.instance_template.rsplit("/", 1)[-1]
            if template not in ours:
                continue
            found.append(Found(Resource("instance_group", project, group.name, **{scope: where}),
                               "READY", size=group.target_size, template=template, added=ours[template]))
    return found


def _tpu_lists(clients, project: str, name: str, zones: Iterable[str]) -> list[Found]:
    found = []
    for zone in zones:
        owned = set()
        for qr in clients.list_queued_resources(project, zone):
            nodes = list(qr.tpu.node_spec)
            if not any(spec.node.labels.get(RUN_LABEL) == name for spec in nodes):
                continue
            rid = qr.name.rsplit("/", 1)[-1]
            owned.update(spec.node_id for spec in nodes)
            from google.cloud import tpu_v2

            state = tpu_v2.QueuedResourceState.State(qr.state.state).name
            found.append(Found(Resource("queued_resource", project, rid, zone=zone), state,
                               nodes[0].node.metadata.get(QUEUE_KEY) if nodes else None,
                               machine_type=nodes[0].node.accelerator_type if nodes else None,
                               added=nodes[0].node.labels.get(ADD_LABEL) if nodes else None))
        for node in clients.list_nodes(project, zone):
            node_id = node.name.rsplit("/", 1)[-1]
            if node.labels.get(RUN_LABEL) != name or node_id in owned:
                continue  # a queued resource's node goes with it
            found.append(Found(Resource("tpu_node", project, node_id, zone=zone), node.state.name,
                               node.metadata.get(QUEUE_KEY), machine_type=node.accelerator_type,
                               added=node.labels.get(ADD_LABEL)))
    return found


def find_run(clients: Clients, project: str, name: str, kind: str | None, zones: Iterable[str],
             regions: Iterable[str] = ()) -> list[Found]:
    """Every resource of run `name` in `project` the cloud lists in `zones` and `regions` (see the module
    docstring); `kind` "vm" or "tpu" lists only that API's collections, None both."""
    zones, regions = list(dict.fromkeys(zones)), list(dict.fromkeys(regions))
    found = []
    if kind in (None, "vm"):
        found += _compute_lists(clients.compute_clients(), project, name, zones, regions)
    if kind in (None, "tpu") and zones:
        found += _tpu_lists(clients.tpu_clients(), project, name, zones)
    log.info("event=cloud_listed run=%s project=%s found=%d", name, project, len(found))
    return found


@dataclasses.dataclass(frozen=True)
class Member:
    """A VM of a managed instance group, as listManagedInstances shows it
    (https://cloud.google.com/compute/docs/reference/rest/v1/instanceGroupManagers/listManagedInstances)."""

    name: str
    zone: str
    status: str  # instanceStatus: RUNNING, STOPPING, ... ("" while the group has not made it yet)
    action: str  # currentAction: NONE, CREATING, DELETING, RECREATING, ...


def group_members(clients: Clients, group: Resource) -> list[Member]:
    compute = clients.compute_clients()
    if group.zone:
        listed = compute.zonal_groups.list_managed_instances(project=group.project, zone=group.zone,
                                                             instance_group_manager=group.name)
    else:
        listed = compute.regional_groups.list_managed_instances(project=group.project, region=group.region,
                                                                instance_group_manager=group.name)
    members = []
    for managed in listed:
        parts = managed.instance.split("/")
        zone = parts[parts.index("zones") + 1] if "zones" in parts else (group.zone or "")
        members.append(Member(parts[-1], zone, managed.instance_status or "", managed.current_action or ""))
    return members


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """Where to look for a run's resources by its label: its name and project, and the zones and regions it may
    have used (the run file's and the record's together)."""

    name: str
    project: str
    zones: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()


def identity(record, fields=None, project: str | None = None) -> RunIdentity | None:
    """The run's identity from its record (run/run.json) and, when given, the run file's fields (runfile.RunFile);
    None when neither names the run. The run file's name wins: it is the label its resources carry."""
    recorded = record.read_run() or {}
    name = fields.name if fields is not None else recorded.get("name")
    if not name:
        return None
    project = project or (fields.project if fields is not None else None) or recorded.get("project")
    project = resolve_project(record.store.url("run/run.json"), project)
    added = list((recorded.get("added") or {}).values())  # gcs-spawner add's groups (gcs_spawner/add.py)
    zones = [*(fields.fleet.zones if fields is not None else ()), *recorded.get("zones", ()),
             *((recorded.get("fleet") or {}).get("zones") or ()), *(a["zone"] for a in added if a.get("zone"))]
    regions = [r for r in (fields.fleet.region if fields is not None else None, recorded.get("region"),
                           (recorded.get("fleet") or {}).get("region"), *(a.get("region") for a in added)) if r]
    return RunIdentity(name, project, tuple(dict.fromkeys(zones)), tuple(dict.fromkeys(regions)))


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


class DeleteError(Exception):
    """Some deletes failed; the message names each (run the command again once the cause is fixed)."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


def delete_all(clients: Clients, resources: list[Resource], parallel: int = 8) -> dict[Resource, str]:
    """Delete `resources` in record.KINDS order (a group before its template), every one of a kind at once; each
    resource's outcome: "deleted", or "gone" (404: deleted already). Raises DeleteError naming every failure,
    after the rest of its kind is done."""
    import concurrent.futures

    from google.api_core import exceptions as api_exceptions

    from fleet import gapi
    from gcs_spawner.record import KINDS

    outcomes: dict[Resource, str] = {}
    for kind in KINDS:
        batch = [r for r in resources if r.kind == kind]
        if not batch:
            continue
        client = clients.compute_clients() if kind in ("instance_group", "instance_template") else clients.tpu_clients()

        def one(resource: Resource) -> str:
            try:
                client.send(delete_request(resource))
            except api_exceptions.NotFound:
                return "gone"
            return "deleted"

        failures = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(parallel, len(batch)))) as pool:
            futures = {pool.submit(one, r): r for r in batch}
            for future in concurrent.futures.as_completed(futures):
                resource = futures[future]
                try:
                    outcomes[resource] = future.result()
                except gapi.API_ERRORS as err:
                    failures.append(f"{resource.describe()}: {err}")
                    continue
                log.info("event=%s resource=%s", outcomes[resource], resource.describe())
        if failures:
            error = DeleteError(f"{len(failures)} of {len(batch)} {kind} deletes failed (run the command again once "
                                "fixed; the rest is deleted):\n  " + "\n  ".join(sorted(failures)))
            error.outcomes = outcomes
            raise error
    return outcomes
