"""The fake Compute and TPU APIs answering the real `gcloud compute` and `gcloud compute tpus` commands
that docs/CLOUD.md shows (through gcloud's api_endpoint_overrides; tests/gcloudcli.py), every request
still checked against Google's discovery documents by the fake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cloud.fakecloud import FakeCloud
from tests.gcloudcli import PROJECT, Gcloud, write_config

REGION, ZONE = "us-west4", "us-west4-a"


@pytest.fixture
def gcloud(cloud: FakeCloud, tmp_path: Path) -> Gcloud:
    return Gcloud(write_config(tmp_path / "gcloud-config", compute=cloud.url, tpu=cloud.url))


def test_gcloud_network_commands_of_the_docs_make_the_nat_router_and_private_google_access(gcloud: Gcloud,
                                                                                          cloud: FakeCloud):
    cloud.set_region(PROJECT, REGION, {"CPUS": (96, 8), "PREEMPTIBLE_CPUS": (512, 0)})
    subnet = f"projects/{PROJECT}/regions/{REGION}/subnetworks/default"
    cloud.add(subnet, {"name": "default", "privateIpGoogleAccess": False})
    # docs/CLOUD.md, "Quotas" and "Network: Cloud NAT or Private Google Access".
    described = json.loads(gcloud("compute", "regions", "describe", REGION, "--format=json").stdout)
    assert {q["metric"]: q["limit"] for q in described["quotas"]} == {"CPUS": 96, "PREEMPTIBLE_CPUS": 512}
    gcloud("compute", "routers", "create", "nat-router", "--network", "default", "--region", REGION)
    gcloud("compute", "routers", "nats", "create", "nat", "--router", "nat-router", "--region", REGION,
           "--auto-allocate-nat-external-ips", "--nat-all-subnet-ip-ranges")
    router = cloud.resources[f"projects/{PROJECT}/regions/{REGION}/routers/nat-router"]
    assert router["network"].endswith(f"/projects/{PROJECT}/global/networks/default")
    assert router["nats"] == [{"name": "nat", "natIpAllocateOption": "AUTO_ONLY",
                               "sourceSubnetworkIpRangesToNat": "ALL_SUBNETWORKS_ALL_IP_RANGES"}]
    gcloud("compute", "networks", "subnets", "update", "default", "--region", REGION, "--enable-private-ip-google-access")
    assert cloud.resources[subnet]["privateIpGoogleAccess"] is True


def test_gcloud_tpu_commands_of_the_docs_list_and_delete_queued_resources(gcloud: Gcloud, cloud: FakeCloud):
    location = f"projects/{PROJECT}/locations/{ZONE}"
    cloud.add(f"{location}/queuedResources/spawn-tpu-0000", {"name": f"{location}/queuedResources/spawn-tpu-0000",
                                                               "state": {"state": "ACTIVE"}})
    cloud.add(f"{location}/nodes/spawn-tpu-0000", {"name": f"{location}/nodes/spawn-tpu-0000", "state": "READY",
                                                   "acceleratorType": "v5litepod-8",
                                                   "queuedResource": f"{location}/queuedResources/spawn-tpu-0000"})
    # docs/CLOUD.md, "Keeping a TPU fleet alive": what the keeper sees, and a queued resource deleted by hand.
    listed = json.loads(gcloud("compute", "tpus", "queued-resources", "list", "--zone", ZONE, "--format=json").stdout)
    assert [(q["name"].rsplit("/", 1)[1], q["state"]["state"]) for q in listed] == [("spawn-tpu-0000", "ACTIVE")]
    nodes = json.loads(gcloud("compute", "tpus", "tpu-vm", "list", "--zone", ZONE, "--format=json").stdout)
    assert [(n["name"].rsplit("/", 1)[1], n["acceleratorType"]) for n in nodes] == [("spawn-tpu-0000", "v5litepod-8")]
    gcloud("compute", "tpus", "queued-resources", "delete", "spawn-tpu-0000", "--zone", ZONE, "--force", "--quiet")
    assert not [name for name in cloud.resources if name.startswith(location)]
    [delete] = cloud.calls("DELETE")
    assert delete.query.get("force", "").lower() == "true"


def test_a_gcloud_command_the_fake_does_not_emulate_is_a_400_naming_it(gcloud: Gcloud):
    answer = gcloud("compute", "networks", "list", check=False)
    assert answer.returncode != 0 and b"the fake does not emulate GET" in answer.stderr and b"networks" in answer.stderr
