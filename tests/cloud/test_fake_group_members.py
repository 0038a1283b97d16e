"""The fake Compute API's managed instance groups, with a `machines` hook (what the fleet rehearsal
boots): members made from the group's template up to its size and named as the API documents, the
`created-by` attribute Compute Engine sets, deleteInstances lowering the size, a stopped member
recreated under its name, the group's delete taking its members along."""

from __future__ import annotations

import re
from pathlib import Path

from fleet import compute, launch
from tests.cloud.fakecloud import PROJECT_NUMBER, FakeCloud

REPO = Path(__file__).resolve().parents[2]
GROUP = "projects/proj-a/zones/z1/instanceGroupManagers/spawn-worker"


class Recorder:
    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self.resources: dict[str, dict] = {}

    def created(self, instance: str, resource: dict) -> None:
        self.events.append(("created", instance))
        self.resources[instance] = resource

    def deleted(self, instance: str) -> None:
        self.events.append(("deleted", instance))


def test_a_group_keeps_its_members_as_a_managed_instance_group_does(cloud: FakeCloud, compute_clients: compute.ComputeClients):
    machines = cloud.machines = Recorder()
    launch.create_template(REPO / "templates" / "vm.yaml", "proj-a", "gs://bkt/jobs/j", "gs://bkt/code/c", clients=compute_clients)
    launch.create_group("proj-a", "spawn-worker", 3, zone="z1", clients=compute_clients)
    members = cloud.members(GROUP)
    assert [e for e in machines.events] == [("created", m) for m in members] and len(members) == 3
    assert all(re.fullmatch(r"projects/proj-a/zones/z1/instances/spawn-worker-[a-z0-9]{4}", m) for m in members)
    items = {i["key"]: i["value"] for i in machines.resources[members[0]]["metadata"]["items"]}
    assert items["created-by"] == f"projects/{PROJECT_NUMBER}/zones/z1/instanceGroupManagers/spawn-worker"
    assert items["spawn-queue"] == "gs://bkt/jobs/j" and "startup-script" in items

    # A member leaving through deleteInstances: gone, the size lowered, not made again.
    name = members[0].rsplit("/", 1)[1]
    compute_clients.send(compute.remove_group_member("proj-a", compute.GroupRef.parse(f"projects/1/zones/z1/instanceGroupManagers/spawn-worker"), "z1", name))
    assert cloud.members(GROUP) == members[1:] and cloud.resources[GROUP]["targetSize"] == 2
    assert machines.events[-1] == ("deleted", members[0]) and members[0] not in cloud.resources

    # A member that stops by itself (a preempted spot VM) is made again, under its name.
    machines.events.clear()
    assert cloud.stopped(members[1]) == GROUP
    assert machines.events == [("created", members[1])] and cloud.members(GROUP) == members[1:]
    assert cloud.resources[members[1]]["status"] == "RUNNING"

    # The group's delete takes its members along.
    machines.events.clear()
    compute_clients.send(compute.delete_group("proj-a", "spawn-worker", zone="z1"))
    compute_clients.send(compute.delete_template("proj-a", "spawn-worker"))
    assert sorted(machines.events) == sorted(("deleted", m) for m in members[1:])
    assert not [k for k in cloud.resources if "/instances/" in k or "instanceGroupManagers" in k or "instanceTemplates" in k]
