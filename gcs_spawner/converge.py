"""The difference `up` prints before it asks: the run file against the run's record (run/run.json) and what the
cloud lists under the run's label (gcs_spawner/cloud.py), as changes to make.

Sans-I/O: `difference(...)` takes what was read and returns the changes, or raises `Refused`; `up` does the
reading and the sending (gcs_spawner/fleetstep.py). The rules:

- **What identifies a run cannot change.** Its name (the record's, and its resources' label), its queue (the record,
  the job and the tasks live there, and every machine was told it), its job (the tasks were cut from it; checked by
  `up`'s validation against job.json) and its project. A change is refused with the reason and what to do.
- **The fleet's machines** (the spec, the zones or region, the code URL the machines are told): a change made since
  the record's `fleet.spec_hash` (or a template in the cloud whose machine type is not the spec's) *replaces*: the
  old template or TPU VMs are deleted and new ones made. Their running tasks go back to the queue when their leases
  lapse (docs/PROTOCOL.md), so no finished work is lost.
- **The count**: a change against the record's `fleet.count` *resizes* the VM group, or *creates* and *deletes*
  TPU VMs (the highest numbers go first).
- What the record holds but the cloud lacks (deleted by hand, a machine that deleted itself) is *created* again.
- What `gcs-spawner add` made (labelled `spawn-add`, gcs_spawner/add.py) is not the run file's fleet: no change.

`record_fleet(run)` is what `up` writes into run/run.json once the machines step has been applied, and only then:
the record says what the cloud was made to be, never what was only asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from gcs_spawner.checks import CheckError
from gcs_spawner.cloud import Found
from gcs_spawner.runfile import Run

#: Queued resource and TPU VM states that are, or will be, a working TPU VM (fleet/keeper.py's ALIVE, and READY).
ALIVE_TPU = ("CREATING", "ACCEPTED", "PROVISIONING", "WAITING_FOR_RESOURCES", "ACTIVE", "READY", "STATE_UNSPECIFIED")


class Refused(CheckError):
    """The run file changes what identifies the run; the message says what and why, and what to do (exit 65)."""


@dataclasses.dataclass(frozen=True)
class Change:
    action: str  # create | resize | replace | delete
    what: str  # the resource, as record.Resource.describe() says it, or a count of them
    detail: str = ""

    def line(self) -> str:
        return f"  {self.action:<8}{self.what}" + (f": {self.detail}" if self.detail else "")


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record_fleet(run: Run) -> dict:
    """The fleet as the run file says it, with the hashes `difference` compares: `spec_hash` (what each machine is)
    and `config_hash` (that and the count)."""
    fleet = run.fields.fleet
    machine = {"spec": run.spec.model_dump(mode="json"), "zones": list(fleet.zones), "region": fleet.region,
               "code": run.fields.code.url}
    spec_hash = _digest(machine)
    return {"kind": run.kind, "accelerator": run.accelerator, "count": fleet.count, "machines": run.machines,
            "zones": list(fleet.zones), "region": fleet.region, "spot": run.spec.spot, "spec_hash": spec_hash,
            "config_hash": _digest({"machine": spec_hash, "count": fleet.count})}


@dataclasses.dataclass
class Difference:
    changes: list[Change]
    found: list[Found] = dataclasses.field(default_factory=list)  # the run's resources the cloud listed
    replace: bool = False  # the machines are replaced (delete the old ones first)
    resize_to: int | None = None  # VM: the group's new target size
    delete_tpus: list[Found] = dataclasses.field(default_factory=list)  # TPU count down: these go

    def lines(self) -> list[str]:
        return [change.line() for change in self.changes]


def refuse_identity(run: Run, project: str, recorded: dict | None, found: list[Found]) -> None:
    """Raise Refused when the run file changes what identifies the run (the module docstring's first rule)."""
    file = run.file
    if recorded is not None:
        if recorded.get("name") != run.name:
            raise Refused(
                f"{file}: name: the queue {run.queue} holds the record of run {recorded.get('name')!r}, not "
                f"{run.name!r}; a run's name labels its resources, so renaming it would lose them: put name back to "
                f"{recorded.get('name')!r}, or give the new run its own queue")
        if recorded.get("project") not in (None, project):
            raise Refused(
                f"{file}: project: run {run.name!r} was made in project {recorded['project']!r}, not {project!r}; "
                f"put project back, or run 'gcs-spawner down {file}' with the old project first")
    elsewhere = sorted({f.queue for f in found if f.queue and f.queue != run.queue})
    if elsewhere:
        where = ", ".join(f.resource.describe() for f in found if f.queue in elsewhere)
        raise Refused(
            f"{file}: queue: run {run.name!r} already has machines working on the queue {elsewhere[0]} ({where}); "
            f"the queue holds a run's record, job and tasks, so it cannot change under a live run: put queue back "
            f"to {elsewhere[0]}, or delete the old run first: gcs-spawner down {elsewhere[0]} --yes")


def difference(run: Run, project: str, recorded: dict | None, found: list[Found], tasks: int,
               claimable: int | None = None) -> Difference:
    """The changes that make the cloud what the run file says (the module docstring's rules). `tasks`: the run's
    task count; `claimable`: tasks a new TPU VM could take now (None: all of them)."""
    refuse_identity(run, project, recorded, found)
    found = [f for f in found if not f.added]  # `gcs-spawner add`'s machines are not the run file's fleet
    want = record_fleet(run)
    before = (recorded or {}).get("fleet") or {}
    claimable = tasks if claimable is None else claimable
    changes: list[Change] = []
    diff = Difference(changes, found)
    spec_changed = bool(before) and (before.get("spec_hash") != want["spec_hash"] or before.get("kind") != run.kind)
    if run.kind == "vm":
        templates = [f for f in found if f.resource.kind == "instance_template"]
        groups = [f for f in found if f.resource.kind == "instance_group"]
        spec_changed = spec_changed or any(t.machine_type and t.machine_type != run.spec.machine_type
                                           for t in templates)
        size = min(run.fields.fleet.count, max(1, tasks))
        if (spec_changed and (templates or groups)) or any(f.resource.kind in ("queued_resource", "tpu_node")
                                                           for f in found):
            diff.replace = True
            old = ", ".join(f.resource.describe() for f in found)
            changes.append(Change("replace", f"{len(found)} resources ({old})",
                                  f"the machines change ({_what_changed(before, want, templates, run)}): the old "
                                  f"ones are deleted, then a new template and a group of {size} made; their running "
                                  "tasks go back to the queue"))
            return diff
        if not templates:
            changes.append(Change("create", f"instance_template {run.name} (global)", run.spec.machine_type))
        if not groups:
            changes.append(Change("create", f"instance_group {run.name} ({run.fields.fleet.zones[0] if run.fields.fleet.zones else run.fields.fleet.region})",
                                  f"{size} x {run.spec.machine_type}"))
        elif before and before.get("count") != want["count"]:
            group = groups[0]
            diff.resize_to = size
            changes.append(Change("resize", group.resource.describe(),
                                  f"count {before.get('count')} -> {want['count']} (target size {group.size} -> {size})"))
        return diff

    tpus = [f for f in found if f.resource.kind in ("queued_resource", "tpu_node")]
    alive = [f for f in tpus if f.state in ALIVE_TPU]
    spec_changed = spec_changed or any(f.machine_type and f.machine_type != run.spec.accelerator_type for f in tpus)
    spec_changed = spec_changed or any(f.resource.kind in ("instance_template", "instance_group") for f in found)
    if spec_changed and found:
        diff.replace = True
        changes.append(Change("replace", f"{len(found)} resources ({', '.join(f.resource.describe() for f in found)})",
                              f"the machines change ({_what_changed(before, want, [], run)}): the old ones are "
                              "deleted, then new TPU VMs made; their running tasks go back to the queue"))
        return diff
    extra = sorted(alive, key=lambda f: f.resource.name)[run.machines:]
    if extra:
        diff.delete_tpus = extra
        for f in extra:
            changes.append(Change("delete", f.resource.describe(), f"count {before.get('count')} -> {want['count']}"))
    missing = max(0, min(run.machines, claimable) - len(alive))
    if missing:
        noun = "queued resource" if run.spec.use_queued_resources else "TPU VM"
        recount = f"; count {before.get('count')} -> {want['count']}" if before.get("count") not in (None, want["count"]) else ""
        changes.append(Change("create", f"{missing} {noun}{'s' if missing != 1 else ''}",
                              f"{run.spec.accelerator_type} in {', '.join(run.fields.fleet.zones)}{recount}"))
    return diff


def _what_changed(before: dict, want: dict, templates: list[Found], run: Run) -> str:
    said = []
    if before.get("kind") not in (None, want["kind"]):
        said.append(f"kind {before['kind']} -> {want['kind']}")
    if before.get("accelerator") not in (None, want["accelerator"]):
        said.append(f"{before['accelerator']} -> {want['accelerator']}")
    for t in templates:
        if t.machine_type and t.machine_type != run.accelerator and not said:
            said.append(f"{t.machine_type} -> {run.accelerator}")
    if before.get("zones") not in (None, want["zones"]) or before.get("region") not in (None, want["region"]):
        said.append(f"where: {before.get('zones') or before.get('region')} -> {want['zones'] or want['region']}")
    return "; ".join(said) or "the spec"
