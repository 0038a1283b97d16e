"""Multi-host slices on the cloud side: roles from the (fake) TPU metadata server, spawn.py options from
fleet.service, multi-host and multislice queued resources through the (fake) TPU API, and a slice's
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


def test_multislice_is_one_queued_resource_with_a_node_per_slice(
    cloud: FakeCloud, tpu_clients: tpu.TpuClients, tmp_path: Path, capsys
):
    spec = _spec(tmp_path, accelerator_type="v6e-8", runtime_version="v2-alpha-tpuv6e", slices=3,
                 spawn_flags=["--on-empty", "delete-when-drained"])  # fmt: skip
    launch.create_tpus(spec, "proj-a", "us-east5-b", 1, QUEUE, CODE, dry_run=True)
    [printed] = json.loads(capsys.readouterr().out)
    [node_spec] = printed["fields"]["queuedResource"]["tpu"]["nodeSpec"]
    assert node_spec["multisliceParams"] == {"nodeCount": 3, "nodeIdPrefix": "spawn-tpu-0000"}
    assert "nodeId" not in node_spec
    assert cloud.requests == []

    launch.create_tpus(spec, "proj-a", "us-east5-b", 1, QUEUE, CODE, clients=tpu_clients)
    nodes = sorted(k.rsplit("/", 1)[1] for k in cloud.resources if "/nodes/" in k)
    assert nodes == ["spawn-tpu-0000-0", "spawn-tpu-0000-1", "spawn-tpu-0000-2"]
    tpu_clients.send(tpu.delete_queued_resource("projects/proj-a/locations/us-east5-b/queuedResources/spawn-tpu-0000"))
    assert not [k for k in cloud.resources if "/nodes/" in k]


def test_multislice_refuses_a_delete_on_idle_that_would_take_the_other_slices_along(tmp_path: Path):
    spec = _spec(tmp_path, slices=2)  # the template's flags say --on-empty delete
    with pytest.raises(specs.SpecError, match="use '--on-empty delete-when-drained'"):
        specs.load_spec(spec)


def test_a_slice_deletes_itself_once_from_its_leader(tmp_path: Path):
    """Leader and follower both run `--on-empty delete`; only the leader's self-delete hook runs."""
    queue = str(tmp_path / "queue")
    submit(open_store(queue), b"{}", [])
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
