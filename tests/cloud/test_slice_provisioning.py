"""Multi-host slices on the cloud side: roles from the (fake) TPU metadata server, spawn.py options from
fleet.service, multi-host queued resources and `slices: K` as K independent ones through the (fake) TPU API, and a slice's
single self-deletion from its leader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleet import launch, specs, tpu
from fleet.metadata import MetadataClient
from fleet.service import ServiceConfigError, worker_argv
from fleet.slice import COORDINATOR_PORT, HostRole, endpoint_addresses, host_role
from objectstore import open_store
from taskqueue.claims import ClaimOptions, Claimer
from taskqueue.submit import submit
from tests.cloud.fakecloud import FakeCloud
from tests.cloud.fakemetadata import FakeMetadata, tpu_vm

REPO = Path(__file__).resolve().parents[2]
TPU_SPEC = REPO / "templates" / "tpu.yaml"
QUEUE, CODE = "gs://bkt/jobs/j1", "gs://bkt/code/run1"
ATTRS = {"spawn-queue": QUEUE, "spawn-consumer": "python consume.py", "spawn-flags": "--on-empty delete"}


def slice_host(metadata_server: FakeMetadata, index: int, hosts: int = 4) -> None:
    metadata_server.values.update(tpu_vm("p", "us-west4-a", "big-slice", ATTRS, hosts=hosts))
    metadata_server.values["instance/attributes/agent-worker-number"] = str(index)
    env = metadata_server.values["instance/attributes/tpu-env"].replace("WORKER_ID: '0'", f"WORKER_ID: '{index}'")
    metadata_server.values["instance/attributes/tpu-env"] = env


@pytest.mark.parametrize("index", [0, 1, 3])
def test_every_host_learns_its_role_and_host_zero_leads(metadata_server: FakeMetadata, metadata: MetadataClient, index):
    slice_host(metadata_server, index)
    role = host_role(metadata)
    assert role == HostRole(slice_id="big-slice", hosts=4, host_index=index, coordinator=f"10.0.0.2:{COORDINATOR_PORT}")
    assert role.is_leader == (index == 0)
    argv = worker_argv(metadata, python="/venv/python")
    assert argv[argv.index("--host-index") + 1] == str(index)
    assert argv[-8:] == ["--slice-id", "big-slice", "--slice-hosts", "4", "--host-index", str(index),
                         "--coordinator", f"10.0.0.2:{COORDINATOR_PORT}"]  # fmt: skip


def test_single_host_tpu_vm_gets_no_slice_options(metadata_server: FakeMetadata, metadata: MetadataClient):
    metadata_server.values.update(tpu_vm("p", "us-west4-a", "small", ATTRS, hosts=1))
    assert host_role(metadata) is None
    assert "--slice-id" not in worker_argv(metadata)


def test_both_endpoint_formats_give_addresses_in_worker_order():
    assert endpoint_addresses("w-0:0:10.1.0.5,w-1:1:10.1.0.6") == ["10.1.0.5", "10.1.0.6"]
    assert endpoint_addresses("t1v-n-a-w-0,t1v-n-a-w-1") == ["t1v-n-a-w-0", "t1v-n-a-w-1"]


def test_inconsistent_slice_metadata_fails_naming_the_attribute(metadata_server: FakeMetadata, metadata: MetadataClient):
    slice_host(metadata_server, 0)
    metadata_server.values["instance/attributes/agent-worker-number"] = "7"
    with pytest.raises(ServiceConfigError, match="agent-worker-number 7 is past the 4 worker-network-endpoints"):
        worker_argv(metadata)


def _spec(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load(TPU_SPEC.read_text())
    raw.update(changes)
    path = tmp_path / "tpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_multi_host_queued_resource_is_created_and_deleted_through_the_tpu_api(
    cloud: FakeCloud, tpu_clients: tpu.TpuClients, tmp_path: Path
):
    spec = _spec(tmp_path, accelerator_type="v5litepod-16")
    launch.create_tpus(spec, "proj-a", "us-west4-a", 1, QUEUE, CODE, clients=tpu_clients)
    qr_name = "projects/proj-a/locations/us-west4-a/queuedResources/spawn-tpu-0000"
    node = cloud.resources["projects/proj-a/locations/us-west4-a/nodes/spawn-tpu-0000"]
    assert node["acceleratorType"] == "v5litepod-16" and len(node["networkEndpoints"]) == 4
    assert node["queuedResource"] == qr_name
    tpu_clients.send(tpu.delete_queued_resource(qr_name))
    assert not [k for k in cloud.resources if "/nodes/" in k or "/queuedResources/" in k]
    assert cloud.calls("DELETE")[-1].query.get("force") == "true"


def test_slices_are_independent_single_slice_queued_resources(cloud: FakeCloud, tpu_clients: tpu.TpuClients, tmp_path: Path, capsys):
    """`slices: 3` makes 3 queued resources of one slice each, never one multislice queued resource:
    a multislice's MEGASCALE_* tpu-env would make JAX and libtpu expect one 3-slice program, and a
    preemption would take all 3 slices (docs/CLOUD.md, "Slices")."""
    spec = _spec(tmp_path, accelerator_type="v6e-8", runtime_version="v2-alpha-tpuv6e", slices=3)
    launch.create_tpus(spec, "proj-a", "us-east5-b", 1, QUEUE, CODE, dry_run=True, bodies=True)
    printed = json.loads(capsys.readouterr().out)
    assert [p["fields"]["queuedResourceId"] for p in printed] == ["spawn-tpu-0000", "spawn-tpu-0001", "spawn-tpu-0002"]
    for request in printed:
        [node_spec] = request["fields"]["queuedResource"]["tpu"]["nodeSpec"]
        assert node_spec["nodeId"] == request["fields"]["queuedResourceId"] and "multisliceParams" not in node_spec
    assert cloud.requests == []

    launch.create_tpus(spec, "proj-a", "us-east5-b", 2, QUEUE, CODE, clients=tpu_clients)
    where = "projects/proj-a/locations/us-east5-b"
    assert sorted(k.rsplit("/", 1)[1] for k in cloud.resources if "/queuedResources/" in k) == [
        f"spawn-tpu-{i:04d}" for i in range(6)]
    # One slice preempted: its queued resource is SUSPENDED and its node gone; the other five keep working.
    cloud.set_queued_resource_state(f"{where}/queuedResources/spawn-tpu-0001", "SUSPENDED")
    assert sorted(k.rsplit("/", 1)[1] for k in cloud.resources if "/nodes/" in k) == [
        f"spawn-tpu-{i:04d}" for i in (0, 2, 3, 4, 5)]


def test_slices_may_delete_themselves_when_idle(tmp_path: Path):
    """Each slice owns its queued resource, so the template's `--on-empty delete` is safe with slices."""
    spec = specs.load_spec(_spec(tmp_path, slices=2))
    assert spec.slices == 2 and ["--on-empty", "delete"] == spec.spawn_flags[:2]


def test_a_slice_deletes_itself_once_from_its_leader(tmp_path: Path):
    """Leader and follower both run `--on-empty delete`; only the leader's self-delete hook runs."""
    queue = str(tmp_path / "queue")
    store = open_store(queue)
    submit(store, b"{}", [("t1", b'{"id": "t1"}')])  # one task, finished: the queue is drained (a job with none is no queue)
    for claim in Claimer(store, ClaimOptions(worker="earlier", idle_timeout_s=0.1, poll_min_s=0.01, poll_max_s=0.05)):
        claim.lease.complete([], 0.0)
    marker = tmp_path / "deleted-by"
    hook = (
        "import sys, taskqueue.cli as c; "
        f"sys.exit(c.run(sys.argv[1:], self_delete=lambda: open({str(marker)!r}, 'a').write(sys.argv[-1] + '\\n')))"
    )
    common = [queue, "--consumer", "true", "--slice-id", "s1", "--slice-hosts", "2", "--coordinator", "127.0.0.1:1",
              "--on-empty", "delete", "--idle-timeout", "1", "--poll", "0.05"]  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-c", hook, *common, "--host-index", str(i), "--worker-id", f"host{i}"],
                         cwd=REPO, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for i in (0, 1)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    assert marker.read_text().splitlines() == ["host0"]
