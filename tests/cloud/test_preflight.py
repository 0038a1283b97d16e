"""fleet.preflight (the pre-flight of `gcs-spawner up` and `add`), against the fake Compute, Resource Manager
and bucket endpoints: roles on the project, its ancestors and the bucket (direct, or possibly
through a group), regional quotas, the bucket's region or dual-region, Private Google Access."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from fleet import iam, preflight
from tests.cloud.fakecloud import FakeCloud

REPO = Path(__file__).resolve().parents[2]
PROJECT = "proj-p"
SA = "worker@proj-p.iam.gserviceaccount.com"
MEMBER = f"serviceAccount:{SA}"


def _world(cloud: FakeCloud, *, project_roles=("roles/compute.instanceAdmin.v1",), bucket_roles=("roles/storage.objectUser",),
           location="US-CENTRAL1", cpus=(96, 0), l4=(8, 0), addresses=(100, 0)) -> None:
    cloud.add(f"projects/{PROJECT}", {"name": PROJECT, "defaultServiceAccount": SA})
    cloud.project_policies[PROJECT] = {"version": 1, "bindings": [{"role": r, "members": [MEMBER]} for r in project_roles]}
    cloud.buckets["bkt"] = {"location": location, "bindings": [{"role": r, "members": [MEMBER]} for r in bucket_roles]}
    # Metrics from Google's Quota.metric enum (compute.v1): G2 has no family CPU quota, so G2 VMs count as CPUS.
    cloud.set_region(PROJECT, "us-central1", {"CPUS": cpus, "N2_CPUS": (24, 0), "PREEMPTIBLE_NVIDIA_L4_GPUS": l4,
                                              "IN_USE_ADDRESSES": addresses})
    cloud.resources[f"projects/{PROJECT}/regions/us-central1"]["zones"] = [f"projects/{PROJECT}/zones/us-central1-a"]
    cloud.add(f"projects/{PROJECT}/zones/us-central1-a/machineTypes/g2-standard-8", {
        "name": "g2-standard-8", "guestCpus": 8, "accelerators": [{"guestAcceleratorType": "nvidia-l4", "guestAcceleratorCount": 1}]})


def _checks(cloud: FakeCloud, count: int, kind: str = "vm", **changes) -> dict[str, preflight.Finding]:
    request = preflight.Request(kind=kind, count=count, region="us-central1", zone="us-central1-a", service_account="default",
                                bucket="bkt", machine_type="g2-standard-8", spot=True, external_ip=True)
    request = dataclasses.replace(request, **changes)
    args = {"client_options": {"api_endpoint": cloud.url}, "credentials": AnonymousCredentials(), "transport": "rest"}
    storage_client = storage.Client(project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": cloud.url})
    findings = preflight.run_checks(PROJECT, request, compute_args=args, rm=iam.ResourceManager(cloud.url), storage_client=storage_client)
    return {f.check: f for f in findings}


def test_everything_in_place_passes(cloud: FakeCloud):
    _world(cloud)
    checks = _checks(cloud, 8)
    assert {k: f.status for k, f in checks.items()} == {
        "role:self-delete": "ok", "role:bucket": "ok", "bucket:location": "ok",
        "quota:CPUS": "ok", "quota:PREEMPTIBLE_NVIDIA_L4_GPUS": "ok", "quota:IN_USE_ADDRESSES": "ok",
    }
    preflight.enforce(list(checks.values()))


def test_shortfalls_name_the_role_the_quota_and_the_location(cloud: FakeCloud):
    _world(cloud, project_roles=(), bucket_roles=(), location="EUROPE-WEST4", l4=(8, 6))
    checks = _checks(cloud, 4)
    assert checks["role:self-delete"].status == "short" and "roles/compute.instanceAdmin.v1" in checks["role:self-delete"].detail
    assert checks["role:bucket"].status == "short" and "roles/storage.objectUser on gs://bkt" in checks["role:bucket"].detail
    assert checks["bucket:location"].status == "short" and "EUROPE-WEST4" in checks["bucket:location"].detail
    assert checks["quota:PREEMPTIBLE_NVIDIA_L4_GPUS"].detail.startswith("need 4, only 2 free in us-central1")
    with pytest.raises(preflight.PreflightError) as caught:
        preflight.enforce(list(checks.values()))
    assert "quota:PREEMPTIBLE_NVIDIA_L4_GPUS" in str(caught.value) and "role:self-delete" in str(caught.value)
    preflight.enforce(list(checks.values()), force=True)  # --force goes on


def test_tpu_quota_is_reported_as_not_checked_and_needs_tpu_admin(cloud: FakeCloud):
    _world(cloud, project_roles=("roles/compute.instanceAdmin.v1", "roles/storage.objectUser"), location="US")
    checks = _checks(cloud, 4, kind="tpu")
    assert checks["quota:tpu"].status == "unchecked"
    assert checks["role:self-delete"].status == "short" and "roles/tpu.admin" in checks["role:self-delete"].detail
    assert checks["bucket:location"].status == "ok" and "multi-region US" in checks["bucket:location"].detail


def _run_checks(cloud: FakeCloud, request: preflight.Request) -> list[preflight.Finding]:
    args = {"client_options": {"api_endpoint": cloud.url}, "credentials": AnonymousCredentials(), "transport": "rest"}
    storage_client = storage.Client(project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": cloud.url})
    return preflight.run_checks(PROJECT, request, compute_args=args, rm=iam.ResourceManager(cloud.url),
                                storage_client=storage_client)


def test_a_tpu_specs_preflight_finds_the_missing_role_and_a_shortfall_stops_unless_forced(cloud: FakeCloud, capsys):
    """What `gcs-spawner up` and `add` check for TPU VMs from a spec (gcs_spawner/checks.py, preflight_requests)."""
    from fleet import specs

    _world(cloud, project_roles=("roles/storage.objectUser",))
    spec = specs.load_spec(REPO / "templates" / "tpu.yaml")
    findings = _run_checks(cloud, preflight.request_for_tpus(spec, 2, "us-central1-a", "gs://bkt/jobs/j"))
    with pytest.raises(preflight.PreflightError, match="lacks roles/tpu.admin"):
        preflight.enforce(findings)
    assert "preflight short      role:self-delete" in capsys.readouterr().out
    preflight.enforce(findings, force=True)


def test_a_groups_preflight_reads_the_template_back(cloud: FakeCloud, compute_clients):
    _world(cloud, cpus=(8, 0))
    cloud.add(f"projects/{PROJECT}/global/instanceTemplates/tmpl", {"name": "tmpl", "properties": {
        "machineType": "g2-standard-8", "scheduling": {"provisioningModel": "SPOT"},
        "networkInterfaces": [{"accessConfigs": [{"type": "ONE_TO_ONE_NAT"}]}],
        "serviceAccounts": [{"email": SA}], "metadata": {"items": [{"key": "spawn-queue", "value": "gs://bkt/jobs/j"}]}}})
    template = compute_clients.templates.get(project=PROJECT, instance_template="tmpl")
    findings = _run_checks(cloud, preflight.request_for_template(template, 3, "us-central1-a", None))
    with pytest.raises(preflight.PreflightError, match="quota:CPUS: need 24, only 8 free in us-central1"):
        preflight.enforce(findings)
    assert not [m for m in cloud.mutations() if "instanceGroupManagers" in m[1]]


def _subnet(cloud: FakeCloud, name: str, private_access: bool, project: str = PROJECT, network: str = "default") -> None:
    cloud.add(f"projects/{project}/regions/us-central1/subnetworks/{name}", {
        "kind": "compute#subnetwork", "name": name, "region": "us-central1", "ipCidrRange": "10.128.0.0/20",
        "network": f"https://www.googleapis.com/compute/v1/projects/{project}/global/networks/{network}",
        "privateIpGoogleAccess": private_access})


def test_machines_without_external_ips_need_private_google_access_on_their_subnet(cloud: FakeCloud):
    _world(cloud)
    _subnet(cloud, "default", private_access=False)
    _subnet(cloud, "other-net", private_access=True, network="other")
    checks = _checks(cloud, 2, external_ip=False)
    finding = checks["network:private-access"]
    assert finding.status == "short" and "subnet default in us-central1 has Private Google Access off" in finding.detail
    assert "--enable-private-ip-google-access" in finding.detail
    with pytest.raises(preflight.PreflightError, match="network:private-access"):
        preflight.enforce(list(checks.values()))
    assert "network:private-access" not in _checks(cloud, 2, external_ip=True)  # an external IP needs no access

    _subnet(cloud, "default", private_access=True)
    assert _checks(cloud, 2, external_ip=False)["network:private-access"].status == "ok"
    # A named Shared VPC subnet is read from its host project.
    _subnet(cloud, "shared", private_access=False, project="host-proj")
    shared = _checks(cloud, 2, external_ip=False, subnetwork="projects/host-proj/regions/us-central1/subnetworks/shared")
    assert shared["network:private-access"].status == "short"
    assert [c.path for c in cloud.calls("GET", "/subnetworks/shared")] == [
        "/compute/v1/projects/host-proj/regions/us-central1/subnetworks/shared"]


@pytest.mark.parametrize(
    "bucket, region, status",
    [
        ({"location": "NAM4", "locationType": "dual-region"}, "us-central1", "ok"),
        ({"location": "NAM4", "locationType": "dual-region"}, "us-east1", "ok"),
        ({"location": "NAM4", "locationType": "dual-region"}, "us-west1", "short"),
        ({"location": "EUR4", "locationType": "dual-region"}, "europe-west4", "ok"),
        ({"location": "ASIA1", "locationType": "dual-region"}, "asia-northeast2", "ok"),
        ({"location": "US", "locationType": "dual-region", "dataLocations": ["US-EAST1", "US-WEST1"]}, "us-west1", "ok"),
        ({"location": "US", "locationType": "dual-region", "dataLocations": ["US-EAST1", "US-WEST1"]}, "us-central1", "short"),
        ({"location": "US", "locationType": "multi-region"}, "us-central1", "ok"),
        ({"location": "US", "locationType": "multi-region"}, "northamerica-northeast1", "short"),
        ({"location": "EU", "locationType": "multi-region"}, "europe-west4", "ok"),
        ({"location": "US-CENTRAL1"}, "us-east1", "short"),
        ({"location": "XYZ9", "locationType": "dual-region"}, "us-east1", "unchecked"),
    ],
)
def test_bucket_in_a_dual_region_holding_the_machines_region_passes(cloud: FakeCloud, bucket: dict, region: str, status: str):
    cloud.buckets["bkt"] = {**bucket, "bindings": []}
    storage_client = storage.Client(project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": cloud.url})
    request = preflight.Request(kind="tpu", count=1, region=region, service_account=SA, bucket="bkt")
    assert preflight.check_location(request, storage_client).status == status


def _roles(cloud: FakeCloud, project_bindings: list[dict], ancestry=(), resource_policies=None) -> dict[str, preflight.Finding]:
    _world(cloud, bucket_roles=("roles/storage.objectUser",))
    cloud.project_policies[PROJECT] = {"version": 3, "bindings": project_bindings}
    cloud.ancestry[PROJECT] = list(ancestry)
    cloud.resource_policies.update(resource_policies or {})
    return _checks(cloud, 1, kind="tpu")


def test_a_role_granted_through_a_group_is_unverified_not_short(cloud: FakeCloud):
    checks = _roles(cloud, [{"role": "roles/tpu.admin", "members": ["group:ml-fleet@example.com"]}])
    finding = checks["role:self-delete"]
    assert finding.status == "unverified"
    assert "roles/tpu.admin is bound to group:ml-fleet@example.com on project proj-p" in finding.detail
    preflight.enforce(list(checks.values()))  # unverified never stops a launch


def test_a_role_inherited_from_a_folder_counts_and_an_unreadable_ancestor_is_unverified(cloud: FakeCloud):
    folder_grant = {"folders/12": {"bindings": [{"role": "roles/tpu.admin", "members": [MEMBER]}]},
                    "organizations/34": {"bindings": []}}
    checks = _roles(cloud, [], ancestry=["folders/12", "organizations/34"], resource_policies=folder_grant)
    assert checks["role:self-delete"].status == "ok" and "on folders/12" in checks["role:self-delete"].detail
    assert [c.path for c in cloud.calls("POST", "/v3/")] == ["/v3/folders/12:getIamPolicy", "/v3/organizations/34:getIamPolicy"]

    cloud.resource_policies.clear()
    cloud.resource_policies["folders/12"] = {"bindings": []}  # the organization's policy cannot be read (403)
    unreadable = _roles(cloud, [], ancestry=["folders/12", "organizations/34"])["role:self-delete"]
    assert unreadable.status == "unverified" and "cannot read the IAM policy of organizations/34" in unreadable.detail


def test_a_role_no_readable_policy_grants_is_short(cloud: FakeCloud):
    checks = _roles(cloud, [{"role": "roles/viewer", "members": ["group:ml-fleet@example.com", MEMBER]}],
                    ancestry=["organizations/34"], resource_policies={"organizations/34": {"bindings": []}})
    finding = checks["role:self-delete"]
    assert finding.status == "short"
    assert "none of project proj-p, organizations/34 grants it" in finding.detail
