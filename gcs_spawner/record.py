"""The run's record in its queue: what `up` made, so that `down` deletes exactly that (docs/PROTOCOL.md, "Layout").

    run/run.json                               the run as `up` last saw it (name, project, queue, ...), and under
                                               `fleet` the fleet as `up` last made it (kind, count, zones, the
                                               spec's hash: gcs_spawner/converge.py), written once it is made
    run/resources/<kind>/<where>/<name>.json   one object per cloud resource `up` (or `keep`) asked for
    run/deleted/<machine>.json                 a machine `down` or `keep` deleted (fleet/machines.py: notes)

`<kind>` is `instance_group`, `instance_template`, `queued_resource` or `tpu_node`; `<where>` is the zone, the
region, or `global` (templates). The resource's state is in the object's custom metadata as well as its body, so
one listing of `run/resources/` (a request per thousand resources) tells `down` and `status` everything.

Contract:

- **Write-ahead.** A resource's object is written `requested` *before* the request that creates it is sent
  (`intend`). Whatever interrupts `up` (Ctrl-C, a crash, a lost answer), every resource that might exist has an
  object, so `down` never misses one. `down` deletes each listed resource and takes a 404 as already gone, so an
  object whose create never reached the API costs one request.
- **Ours, or refused.** A create answered 409 (already exists) is ours exactly when its object was written by an
  earlier `up` of this run; `up` then goes on. Without an object, the name belongs to something else, and `up`
  stops and says so rather than adopt (or later delete) it.
- **States.** `requested`, then `created` once the API said so, then `deleted` once `down` saw it gone. A later
  `up` writes `requested` again. Objects are overwritten only by `up`, `keep` and `down` of this run; two of them
  at once may rewrite a state twice, never lose a resource (each resource has its own object).
- The data (job, tasks, outputs, markers) is never touched by `down`; nor is `run/run.json`, which keeps the
  run's history in the queue.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

from exitcodes import EX_DATAERR
from objectstore import NotFound, ObjectStore

RUN_OBJECT = "run/run.json"
RESOURCES = "run/resources/"
#: Kinds of resource, in the order `down` deletes them: a group before the template it uses (a template in use
#: cannot be deleted: https://cloud.google.com/compute/docs/instance-templates/delete-instance-templates), then
#: TPU queued resources (with force, taking their nodes: fleet/tpu.py), then plain TPU nodes.
KINDS = ("instance_group", "instance_template", "queued_resource", "tpu_node")
STATES = ("requested", "created", "deleted")


class RecordError(Exception):
    """The queue holds another run's record, or a record object that is not one; the message says which."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


@dataclasses.dataclass(frozen=True)
class Resource:
    kind: str
    project: str
    name: str
    zone: str | None = None
    region: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RecordError(f"resource kind {self.kind!r}: expected one of {', '.join(KINDS)}")

    @property
    def scope(self) -> str:
        return "zone" if self.zone else "region" if self.region else "global"

    @property
    def where(self) -> str:
        return self.zone or self.region or "global"

    @property
    def object(self) -> str:
        return f"{RESOURCES}{self.kind}/{self.where}/{self.name}.json"

    def describe(self) -> str:
        return f"{self.kind} {self.name} ({self.where})"


@dataclasses.dataclass(frozen=True)
class Recorded:
    resource: Resource
    state: str
    at: str


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class RunRecord:
    """The `run/` objects of one queue (see the module docstring)."""

    def __init__(self, store: ObjectStore):
        self.store = store

    def read_run(self) -> dict | None:
        try:
            return json.loads(self.store.read(RUN_OBJECT).data)
        except NotFound:
            return None

    def begin(self, summary: dict) -> None:
        """Write `run/run.json`; refuse a queue whose record names another run."""
        earlier = self.read_run()
        if earlier is not None and earlier.get("name") != summary["name"]:
            raise RecordError(
                f"{self.store.url(RUN_OBJECT)} belongs to run {earlier.get('name')!r}, not {summary['name']!r}: "
                "give this run its own queue prefix (a queue holds one run's job, tasks and resources)")
        self.store.put(RUN_OBJECT, (json.dumps({**summary, "up_at": _now()}, indent=1, sort_keys=True) + "\n").encode(),
                       content_type="application/json")

    def update_run(self, fields: dict) -> None:
        """Merge `fields` into `run/run.json` (up, once the machines step made what they say)."""
        earlier = self.read_run() or {}
        self.store.put(RUN_OBJECT, (json.dumps({**earlier, **fields, "up_at": _now()}, indent=1, sort_keys=True)
                                    + "\n").encode(), content_type="application/json")

    def _write(self, resource: Resource, state: str) -> None:
        body = {**dataclasses.asdict(resource), "state": state, "at": _now()}
        self.store.put(resource.object, (json.dumps(body, sort_keys=True) + "\n").encode(),
                       metadata={"state": state, "at": body["at"], "project": resource.project, "scope": resource.scope},
                       content_type="application/json")

    def intend(self, resource: Resource) -> None:
        """Before the create request: from now on `down` will delete it."""
        self._write(resource, "requested")

    def created(self, resource: Resource) -> None:
        self._write(resource, "created")

    def deleted(self, resource: Resource) -> None:
        self._write(resource, "deleted")

    def is_ours(self, resource: Resource) -> bool:
        """Whether an `up` of this run asked for `resource` (its object exists in any state)."""
        page = self.store.list_page(resource.object, page_size=1)
        return any(entry.name == resource.object for entry in page.entries)

    def resources(self) -> list[Recorded]:
        """Every recorded resource, in `down`'s order (KINDS), then by name; from one listing."""
        found = []
        for entry in self.store.list(RESOURCES):
            parts = entry.name[len(RESOURCES):].removesuffix(".json").split("/")
            if len(parts) != 3 or parts[0] not in KINDS:
                raise RecordError(f"{self.store.url(entry.name)} is not a resource record (run/resources/KIND/WHERE/"
                                  "NAME.json); remove it if it was put there by hand")
            kind, where, name = parts
            project = entry.metadata.get("project")
            if project is None:  # a body without its metadata (written by hand): read it
                project = json.loads(self.store.read(entry.name).data)["project"]
            scope = entry.metadata.get("scope") or ("global" if where == "global" else
                                                    "zone" if where[-2:-1] == "-" else "region")
            zone = where if scope == "zone" else None
            region = where if scope == "region" else None
            found.append(Recorded(Resource(kind, project, name, zone=zone, region=region),
                                  entry.metadata.get("state", "requested"), entry.metadata.get("at", "")))
        return sorted(found, key=lambda r: (KINDS.index(r.resource.kind), r.resource.where, r.resource.name))
