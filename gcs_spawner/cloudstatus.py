"""What `status` adds for a run beside the queue's view: the run's record (what `up` and `keep` made, from one
listing of run/resources/), the lost machines that may still bill and the command that deletes them, and with
`--cloud` the cloud's own view: the resources listed under the run's label (gcs_spawner/cloud.py), each group's
members, each queued resource's state, and which lost machines the cloud still has."""

from __future__ import annotations

import collections

from gcs_spawner.record import RunRecord


def record_lines(store) -> list[str]:
    """One line: the resources the record lists, by kind and state (none: no line); and one for the machines
    `gcs-spawner add` made beside the run's fleet (run/run.json's `added`)."""
    record = RunRecord(store)
    listed = record.resources()
    if not listed:
        return []
    counts = collections.Counter((r.resource.kind.replace("_", " "), r.state) for r in listed)
    parts = [f"{n} {kind}{'s' if n != 1 else ''} {state}" for (kind, state), n in sorted(counts.items())]
    lines = [f"run resources (recorded in {store.url('run/resources/')}): " + ", ".join(parts)]
    added = ((record.read_run() or {}).get("added") or {}).values()
    if added:
        lines.append("added beside the fleet (gcs-spawner add): " + ", ".join(
            f"{a['name']}: {a['machines']} x {a['accelerator']} in {a.get('zone') or a.get('region')}" for a in added))
    return lines


def lost_lines(lost: list[str], target: str, still_there: list[str] | None = None) -> list[str]:
    """The lost machines that may still bill, and the command that deletes them (`still_there`: those the cloud
    still has, when it was asked)."""
    if still_there is not None:
        lost = [m for m in lost if m in still_there]
        if not lost:
            return []
        head = f"{len(lost)} lost machine{'s' if len(lost) != 1 else ''} still exist{'s' if len(lost) == 1 else ''}"
    elif not lost:
        return []
    else:
        head = (f"{len(lost)} lost machine{'s' if len(lost) != 1 else ''} may still exist and bill "
                f"(gcs-spawner status {target} --cloud shows which)")
    shown = ", ".join(lost[:10]) + (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
    return [f"{head}: {shown}; gcs-spawner keep {target} --once deletes them"]


def cloud_lines(store, fields=None, project: str | None = None, clients=None) -> tuple[list[str], list[str]]:
    """(lines of the cloud's view beside the record, names of the run's machines the cloud has)."""
    from gcs_spawner import cloud

    record = RunRecord(store)
    who = cloud.identity(record, fields, project)
    if who is None:
        return [f"cloud: {store.url('run/run.json')} names no run, and no run file was given"], []
    clients = clients or cloud.Clients()
    found = cloud.find_run(clients, who.project, who.name, None, who.zones, who.regions)
    lines = [f"cloud (project {who.project}, label spawn-run={who.name}, in {', '.join(who.zones + who.regions)}):"]
    machines = []
    for f in found:
        resource = f.resource
        if resource.kind == "instance_group":
            members = cloud.group_members(clients, resource)
            machines += [m.name for m in members]
            listed = ", ".join(f"{m.name} {m.status or m.action}" for m in members[:10])
            more = f" and {len(members) - 10} more" if len(members) > 10 else ""
            lines.append(f"  {resource.describe()}: target size {f.size}, {len(members)} member"
                         f"{'s' if len(members) != 1 else ''}" + (f": {listed}{more}" if members else "") + _added(f))
        elif resource.kind == "instance_template":
            lines.append(f"  {resource.describe()}: {f.machine_type}{_added(f)}")
        else:
            machines.append(resource.name)
            lines.append(f"  {resource.describe()}: {f.state} ({f.machine_type}){_added(f)}")
    if not found:
        lines.append("  nothing")
    recorded = {r.resource for r in record.resources() if r.state != "deleted"}
    missing = sorted(r.describe() for r in recorded - {f.resource for f in found})
    beyond = sorted(f.resource.describe() for f in found if f.resource not in recorded)
    if missing:
        lines.append(f"  recorded, but not in the cloud (deleted by hand, or by a machine itself): {', '.join(missing)}")
    if beyond:
        lines.append(f"  in the cloud, but not in this queue's record: {', '.join(beyond)} (gcs-spawner down deletes "
                     "them too)")
    return lines, machines


def _added(found) -> str:
    return f" [added: {found.added}]" if found.added else ""
