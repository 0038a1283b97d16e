"""The fakes answer as strictly as Google: every request is checked against Google's discovery
documents (tests/cloud/apischema.py), a body the published schema refuses gets 400
INVALID_ARGUMENT naming the field, and every body the launch tools build passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import yaml
from google.api_core import exceptions as api_exceptions
from google.cloud import compute_v1

from fleet import compute, launch, tpu
from tests.cloud.fakecloud import FakeCloud

REPO = Path(__file__).resolve().parents[2]
QUEUE, CODE = "gs://bkt/jobs/j1", "gs://bkt/code/run1"
QR_URL = "/v2/projects/p/locations/us-west4-a/queuedResources?queuedResourceId=q1"


def _queued_resource(**node) -> dict:
    return {"tpu": {"nodeSpec": [{"parent": "projects/p/locations/us-west4-a", "nodeId": "q1",
                                  "node": {"acceleratorType": "v5litepod-8", "runtimeVersion": "v2-alpha-tpuv5-lite", **node}}]}}


@pytest.mark.parametrize(
    "node, field, message",
    [
        ({"acceleratorTyp": "v5litepod-8"}, "tpu.nodeSpec[0].node.acceleratorTyp",
         "Unknown name \"acceleratorTyp\" at 'tpu.nodeSpec[0].node': Cannot find field."),
        ({"networkConfig": {"enableExternalIps": "false"}}, "tpu.nodeSpec[0].node.networkConfig.enableExternalIps",
         "expected true or false"),
        ({"metadata": ["startup-script"]}, "tpu.nodeSpec[0].node.metadata", "expected an object"),
        ({"health": "FINE"}, "tpu.nodeSpec[0].node.health", "expected one of HEALTH_UNSPECIFIED, HEALTHY"),
    ],
)
def test_a_body_googles_schema_refuses_gets_400_invalid_argument(cloud: FakeCloud, node: dict, field: str, message: str):
    answer = requests.post(cloud.url + QR_URL, json=_queued_resource(**node), timeout=10)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["status"] == "INVALID_ARGUMENT" and message in error["message"]
    [detail] = error["details"]
    assert detail["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    assert detail["fieldViolations"][0]["field"] == field
    assert not cloud.resources  # nothing was made


def test_a_value_outside_an_enum_is_refused_through_the_real_client(cloud: FakeCloud, compute_clients: compute.ComputeClients):
    template = compute_v1.InstanceTemplate(name="t", properties=compute_v1.InstanceProperties(
        machine_type="n2-standard-4", scheduling=compute_v1.Scheduling(provisioning_model="SPOTTY")))
    with pytest.raises(api_exceptions.BadRequest, match="provisioningModel"):
        compute_clients.send(compute.insert_template("p", template))
    assert not cloud.resources


def test_unknown_query_parameters_and_methods_are_refused(cloud: FakeCloud):
    answer = requests.post(cloud.url + QR_URL + "&validateOnly=true", json=_queued_resource(), timeout=10)
    assert answer.status_code == 400 and "Unknown name \"validateOnly\"" in answer.json()["error"]["message"]
    answer = requests.post(cloud.url + "/v2/projects/p/locations/z/queuedResources/q1:restart", json={}, timeout=10)
    assert answer.status_code == 404 and "tpu.v2 has no method" in answer.json()["error"]["message"]
    assert not cloud.resources


def _spec(tmp_path: Path, base: str, **changes) -> Path:
    raw = yaml.safe_load((REPO / "templates" / base).read_text())
    raw.update(changes)
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}-{base}"
    path.write_text(yaml.safe_dump(raw))
    return path


VM_VARIANTS = [
    {},
    {"spot": False, "accelerator": "cpu", "machine_type": "n2-standard-4", "max_run_duration_s": 86400},
    {"machine_type": "n1-standard-8", "gpu_type": "nvidia-tesla-t4", "gpu_count": 2, "spot": False},
    {"external_ip": False, "subnetwork": "regions/us-central1/subnetworks/private", "max_run_duration_s": 3600},
]
TPU_VARIANTS = [
    {},
    {"queued": False},
    {"spot": False, "accelerator_type": "v5litepod-16", "external_ip": False, "subnetwork": "private"},
    {"slices": 2, "service_account": "w@p.iam.gserviceaccount.com", "labels": {"job": "x"}},
]


@pytest.mark.parametrize("changes", VM_VARIANTS)
def test_every_template_the_tools_build_passes_googles_schema(cloud: FakeCloud, compute_clients, tmp_path: Path, changes):
    launch.create_template(_spec(tmp_path, "vm.yaml", **changes), "p", QUEUE, CODE, clients=compute_clients)
    launch.create_group("p", "spawn-worker", 3, zone="us-central1-a", clients=compute_clients)
    launch.create_group("p", "spawn-worker", 3, region="us-central1", clients=compute_clients)
    assert "projects/p/global/instanceTemplates/spawn-worker" in cloud.resources


@pytest.mark.parametrize("changes", TPU_VARIANTS)
def test_every_tpu_request_the_tools_build_passes_googles_schema(cloud: FakeCloud, tpu_clients: tpu.TpuClients, tmp_path: Path,
                                                                 changes):
    launch.create_tpus(_spec(tmp_path, "tpu.yaml", **changes), "p", "us-west4-a", 1, QUEUE, CODE, clients=tpu_clients)
    for created in cloud.calls("POST"):  # each deleted as down deletes it (gcs_spawner/cloud.py, delete_request)
        rid = created.query.get("queuedResourceId") or created.query["nodeId"]
        name = f"projects/p/locations/us-west4-a/{created.path.rsplit('/', 1)[-1]}/{rid}"
        tpu_clients.send(tpu.delete_queued_resource(name) if "queuedResourceId" in created.query else tpu.delete_node(name))
    assert len(cloud.calls("POST")) == changes.get("slices", 1) and not [k for k in cloud.resources if "/locations/" in k]


def test_the_fakes_own_answers_are_held_to_the_schema(cloud: FakeCloud, tpu_clients: tpu.TpuClients):
    cloud.add("projects/p/locations/z/nodes/n1", {"name": "projects/p/locations/z/nodes/n1", "acceleratorTyp": "v4-8"})
    with pytest.raises(api_exceptions.InternalServerError, match="acceleratorTyp"):
        tpu_clients.get_node("projects/p/locations/z/nodes/n1")
    assert len(cloud.schema_breaks) == 1
    cloud.schema_breaks.clear()  # the fixture would fail this test otherwise: the break was the point
