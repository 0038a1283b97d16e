"""fleet/launch.py's builders against the fake Compute and TPU APIs, through the real client libraries: the exact
REST calls (paths and bodies) for templates, groups, TPU nodes and queued resources. (`gcs-spawner up` and `add`
send the same requests, recorded first: tests/cli.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fleet import compute, launch, specs, tpu
from tests.cloud.fakecloud import FakeCloud

REPO = Path(__file__).resolve().parents[2]
VM_SPEC = REPO / "templates" / "vm.yaml"
TPU_SPEC = REPO / "templates" / "tpu.yaml"
QUEUE, CODE = "gs://bkt/jobs/j1", "gs://bkt/code/run1"


def test_create_template_inserts_the_specs_template_through_the_endpoint_override(cloud: FakeCloud, monkeypatch):
    monkeypatch.setenv("FLEET_COMPUTE_ENDPOINT", cloud.url)
    launch.create_template(VM_SPEC, "proj-a", QUEUE, CODE, name="wk-v2", consumer="python consume.py --dtype bf16")
    [call] = cloud.calls()
    assert (call.method, call.path) == ("POST", "/compute/v1/projects/proj-a/global/instanceTemplates")
    assert call.body["name"] == "wk-v2"
    props = call.body["properties"]
    assert props["machineType"] == "g2-standard-8"
    assert props["scheduling"] == {
        "provisioningModel": "SPOT", "instanceTerminationAction": "DELETE", "onHostMaintenance": "TERMINATE",
        "automaticRestart": False,
    }
    assert props["disks"] == [{"boot": True, "autoDelete": True, "initializeParams": {
        "sourceImage": yaml.safe_load(VM_SPEC.read_text())["image"], "diskSizeGb": "200", "diskType": "pd-balanced"}}]
    assert props["networkInterfaces"] == [{"network": "global/networks/default",
                                           "accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}]
    assert props["serviceAccounts"][0]["email"] == "default"
    items = {i["key"]: i["value"] for i in props["metadata"]["items"]}
    assert items["startup-script"] == (REPO / "startup" / "startup.sh").read_text()
    assert (items["spawn-queue"], items["spawn-code"]) == (QUEUE, CODE)
    assert items["spawn-consumer"] == "python consume.py --dtype bf16"
    assert items["spawn-flags"] == "--on-empty delete --preemption-watch auto --lease-ttl 120 --max-attempts 3 --stuck-after 1800 --resident"
    assert "projects/proj-a/global/instanceTemplates/wk-v2" in cloud.resources


def test_dry_run_prints_the_requests_and_calls_nothing(cloud: FakeCloud, capsys: pytest.CaptureFixture):
    launch.create_template(VM_SPEC, "proj-a", QUEUE, CODE, dry_run=True, bodies=True)
    [printed] = json.loads(capsys.readouterr().out)
    assert printed["request"] == "InsertInstanceTemplateRequest"
    assert printed["fields"]["project"] == "proj-a"
    assert printed["fields"]["instanceTemplateResource"]["name"] == "spawn-worker"
    launch.create_tpus(TPU_SPEC, "proj-a", "z1", 3, QUEUE, CODE, dry_run=True, bodies=True)
    printed = json.loads(capsys.readouterr().out)
    assert [p["fields"]["queuedResourceId"] for p in printed] == ["spawn-tpu-0000", "spawn-tpu-0001", "spawn-tpu-0002"]
    assert cloud.requests == []


def test_dry_run_prints_one_short_line_per_request(cloud: FakeCloud, capsys: pytest.CaptureFixture):
    """Without --bodies a dry run is one line per call (before: 58 KB of request bodies for 2 TPUs)."""
    launch.create_tpus(TPU_SPEC, "proj-a", "z1", 2, QUEUE, CODE, dry_run=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"would send CreateQueuedResourceRequest parent=projects/proj-a/locations/z1 "
                     f"queued_resource_id=spawn-tpu-000{i}" for i in (0, 1)]
    launch.create_group("proj-a", "spawn-worker", 8, zone="z1", dry_run=True)
    assert capsys.readouterr().out == ("would send InsertInstanceGroupManagerRequest zone=z1 project=proj-a "
                                       "instance_group_manager_resource.name=spawn-worker "
                                       "instance_group_manager_resource.target_size=8 "
                                       "instance_group_manager_resource.instance_template="
                                       "projects/proj-a/global/instanceTemplates/spawn-worker\n")
    assert cloud.requests == []


def test_bad_spec_fails_naming_the_field_before_any_call(cloud: FakeCloud, tmp_path: Path):
    raw = yaml.safe_load(VM_SPEC.read_text())
    raw["disk_gb"] = -5
    bad = tmp_path / "vm.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(specs.SpecError) as caught:
        launch.create_template(bad, "proj-a", QUEUE, CODE)
    assert f"{bad}: field 'disk_gb' must be a positive integer, got -5" in str(caught.value)
    assert cloud.requests == []


def test_zonal_group_insert_then_resize(cloud: FakeCloud, compute_clients: compute.ComputeClients):
    launch.create_group("proj-a", "spawn-worker", 200, zone="us-central1-a", clients=compute_clients)
    launch.create_group("proj-a", "spawn-worker", 50, zone="us-central1-a", resize=True, clients=compute_clients)
    insert, resize = cloud.calls()
    assert (insert.method, insert.path) == ("POST", "/compute/v1/projects/proj-a/zones/us-central1-a/instanceGroupManagers")
    assert insert.body == {"name": "spawn-worker", "baseInstanceName": "spawn-worker", "targetSize": 200,
                           "instanceTemplate": "projects/proj-a/global/instanceTemplates/spawn-worker",
                           "instanceLifecyclePolicy": {"defaultActionOnFailure": "REPAIR", "forceUpdateOnRepair": "YES"}}
    assert (resize.method, resize.path) == (
        "POST", "/compute/v1/projects/proj-a/zones/us-central1-a/instanceGroupManagers/spawn-worker/resize")
    assert resize.query["size"] == "50"
    assert cloud.resources["projects/proj-a/zones/us-central1-a/instanceGroupManagers/spawn-worker"]["targetSize"] == 50


def test_regional_group_is_created_without_proactive_redistribution(cloud: FakeCloud, compute_clients):
    launch.create_group("proj-a", "tmpl", 8, region="europe-west4", name="fleet-a", clients=compute_clients)
    [call] = [c for c in cloud.calls("POST")]
    assert (call.method, call.path) == ("POST", "/compute/v1/projects/proj-a/regions/europe-west4/instanceGroupManagers")
    assert call.body["targetSize"] == 8 and call.body["name"] == "fleet-a"
    assert call.body["updatePolicy"] == {"instanceRedistributionType": "NONE", "type": "OPPORTUNISTIC"}


def test_spot_tpus_are_queued_resources_with_the_spot_tier(cloud: FakeCloud, tpu_clients: tpu.TpuClients):
    launch.create_tpus(TPU_SPEC, "proj-a", "us-west4-a", 2, QUEUE, CODE, first_index=5, clients=tpu_clients)
    calls = sorted(cloud.calls(), key=lambda r: r.query["queuedResourceId"])
    assert [(c.method, c.path, c.query["queuedResourceId"]) for c in calls] == [
        ("POST", "/v2/projects/proj-a/locations/us-west4-a/queuedResources", "spawn-tpu-0005"),
        ("POST", "/v2/projects/proj-a/locations/us-west4-a/queuedResources", "spawn-tpu-0006"),
    ]
    body = calls[0].body
    assert body["spot"] == {}
    [node_spec] = body["tpu"]["nodeSpec"]
    assert node_spec["parent"] == "projects/proj-a/locations/us-west4-a" and node_spec["nodeId"] == "spawn-tpu-0005"
    node = node_spec["node"]
    assert (node["acceleratorType"], node["runtimeVersion"]) == ("v5litepod-8", "v2-alpha-tpuv5-lite")
    assert node["metadata"]["spawn-queued-resource"] == "spawn-tpu-0005"
    assert node["metadata"]["spawn-accelerator"] == "tpu"
    assert node["metadata"]["startup-script"] == (REPO / "startup" / "startup.sh").read_text()
    assert node["serviceAccount"] == {"scope": ["https://www.googleapis.com/auth/cloud-platform"]}
    assert "schedulingConfig" not in node


def test_non_queued_tpus_are_nodes_with_spot_scheduling(cloud: FakeCloud, tpu_clients: tpu.TpuClients, tmp_path: Path):
    raw = yaml.safe_load(TPU_SPEC.read_text())
    raw["queued"] = False
    spec = tmp_path / "tpu.yaml"
    spec.write_text(yaml.safe_dump(raw))
    launch.create_tpus(spec, "proj-a", "us-west4-a", 1, QUEUE, CODE, clients=tpu_clients)
    [call] = cloud.calls()
    assert (call.method, call.path, call.query["nodeId"]) == ("POST", "/v2/projects/proj-a/locations/us-west4-a/nodes", "spawn-tpu-0000")
    assert call.body["schedulingConfig"] == {"spot": True}
    assert "spawn-queued-resource" not in call.body["metadata"]


def test_failed_creations_are_reported_together(cloud: FakeCloud, tpu_clients: tpu.TpuClients):
    cloud.fail_next(1, 403, path_contains="/queuedResources")
    with pytest.raises(launch.gapi.LaunchError, match="1 of 2 requests failed") as caught:
        launch.create_tpus(TPU_SPEC, "proj-a", "z1", 2, QUEUE, CODE, clients=tpu_clients)
    assert "CreateQueuedResourceRequest spawn-tpu-000" in str(caught.value)
