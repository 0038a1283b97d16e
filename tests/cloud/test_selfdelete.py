"""fleet.selfdelete: each kind of machine deletes itself with the right call, retries transient
errors, and powers off (logging why) when it cannot."""

from __future__ import annotations

import logging

import pytest

from fleet.metadata import MetadataClient
from fleet.selfdelete import delete_self
from tests.cloud.conftest import StubBin
from tests.cloud.fakecloud import FakeCloud
from tests.cloud.fakemetadata import FakeMetadata, gce_vm, tpu_vm

PROJECT, ZONE = "proj-a", "us-central1-b"


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Where `check` leaves its verdict: a temporary directory, never this machine's /var/lib/fleet."""
    monkeypatch.setenv("FLEET_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def poweroff(stubs: StubBin, monkeypatch: pytest.MonkeyPatch) -> StubBin:
    """Stub systemctl and shutdown, and a PATH holding only them: a real poweroff is unreachable."""
    stubs.add("systemctl")
    stubs.add("shutdown")
    monkeypatch.setenv("PATH", str(stubs.dir))
    return stubs


def _delete(metadata: MetadataClient, compute_clients=None, tpu_clients=None) -> None:
    delete_self(metadata, compute_clients=compute_clients, tpu_clients=tpu_clients, attempts=3, max_wait_s=0.05)


def test_zonal_group_member_asks_its_group_to_delete_it(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, compute_clients, poweroff: StubBin
):
    group = f"projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/spawn-worker"
    cloud.add(group, {"name": "spawn-worker", "targetSize": 3})
    metadata_server.values.update(gce_vm(PROJECT, ZONE, "spawn-worker-x1z2", {"created-by": f"projects/123456789012/zones/{ZONE}/instanceGroupManagers/spawn-worker"}))
    _delete(metadata, compute_clients)
    [call] = cloud.calls()
    assert (call.method, call.path) == ("POST", f"/compute/v1/{group}/deleteInstances")
    assert call.body == {"instances": [f"zones/{ZONE}/instances/spawn-worker-x1z2"]}
    assert cloud.resources[group]["targetSize"] == 2
    assert poweroff.calls() == []


def test_regional_group_member_uses_the_regional_delete_instances(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, compute_clients, poweroff: StubBin
):
    group = f"projects/{PROJECT}/regions/us-central1/instanceGroupManagers/fleet-a"
    cloud.add(group, {"name": "fleet-a", "targetSize": 10})
    metadata_server.values.update(gce_vm(PROJECT, ZONE, "fleet-a-abcd", {"created-by": "projects/123456789012/regions/us-central1/instanceGroupManagers/fleet-a"}))
    _delete(metadata, compute_clients)
    [call] = cloud.calls()
    assert (call.method, call.path) == ("POST", f"/compute/v1/{group}/deleteInstances")
    assert call.body["instances"] == [f"zones/{ZONE}/instances/fleet-a-abcd"]
    assert cloud.resources[group]["targetSize"] == 9
    assert poweroff.calls() == []


def test_standalone_vm_deletes_its_instance(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, compute_clients, poweroff: StubBin
):
    cloud.add(f"projects/{PROJECT}/zones/{ZONE}/instances/solo", {"name": "solo"})
    metadata_server.values.update(gce_vm(PROJECT, ZONE, "solo"))
    _delete(metadata, compute_clients)
    assert [(c.method, c.path) for c in cloud.calls()] == [("DELETE", f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances/solo")]
    assert poweroff.calls() == []


def test_tpu_vm_from_a_queued_resource_deletes_it_with_force(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, tpu_clients, poweroff: StubBin
):
    # The node was not made by our tool (no spawn-queued-resource attribute): the TPU API says which.
    location = f"projects/{PROJECT}/locations/us-west4-a"
    cloud.add(f"{location}/queuedResources/qr-7", {"name": f"{location}/queuedResources/qr-7"})
    cloud.add(f"{location}/nodes/node-7", {"name": f"{location}/nodes/node-7", "queuedResource": f"{location}/queuedResources/qr-7"})
    metadata_server.values.update(tpu_vm(PROJECT, "us-west4-a", "node-7"))
    _delete(metadata, tpu_clients=tpu_clients)
    get, delete = cloud.calls()
    assert (get.method, get.path) == ("GET", f"/v2/{location}/nodes/node-7")
    assert (delete.method, delete.path, delete.query.get("force")) == ("DELETE", f"/v2/{location}/queuedResources/qr-7", "true")
    assert cloud.resources == {}
    assert poweroff.calls() == []


def test_tpu_vm_with_the_queued_resource_attribute_skips_the_lookup(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, tpu_clients, poweroff: StubBin
):
    location = f"projects/{PROJECT}/locations/us-west4-a"
    cloud.add(f"{location}/queuedResources/spawn-tpu-0003", {"name": f"{location}/queuedResources/spawn-tpu-0003"})
    metadata_server.values.update(tpu_vm(PROJECT, "us-west4-a", "spawn-tpu-0003", {"spawn-queued-resource": "spawn-tpu-0003"}))
    _delete(metadata, tpu_clients=tpu_clients)
    [call] = cloud.calls()
    assert (call.method, call.path, call.query.get("force")) == ("DELETE", f"/v2/{location}/queuedResources/spawn-tpu-0003", "true")


def test_plain_tpu_node_deletes_its_node(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, tpu_clients, poweroff: StubBin
):
    location = f"projects/{PROJECT}/locations/us-west4-a"
    cloud.add(f"{location}/nodes/plain-1", {"name": f"{location}/nodes/plain-1"})
    metadata_server.values.update(tpu_vm(PROJECT, "us-west4-a", "plain-1"))
    _delete(metadata, tpu_clients=tpu_clients)
    assert [(c.method, c.path) for c in cloud.calls()] == [
        ("GET", f"/v2/{location}/nodes/plain-1"),
        ("DELETE", f"/v2/{location}/nodes/plain-1"),
    ]
    assert poweroff.calls() == []


def test_transient_errors_are_retried_until_the_delete_goes_through(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, compute_clients, poweroff: StubBin
):
    cloud.add(f"projects/{PROJECT}/zones/{ZONE}/instances/solo", {"name": "solo"})
    metadata_server.values.update(gce_vm(PROJECT, ZONE, "solo"))
    cloud.fail_next(2, 503)
    _delete(metadata, compute_clients)
    assert [c.method for c in cloud.calls()] == ["DELETE"] * 3
    assert f"projects/{PROJECT}/zones/{ZONE}/instances/solo" not in cloud.resources
    assert poweroff.calls() == []


def test_machine_that_cannot_delete_itself_logs_why_and_powers_off(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, compute_clients, poweroff: StubBin,
    caplog: pytest.LogCaptureFixture,
):
    metadata_server.values.update(gce_vm(PROJECT, ZONE, "solo"))
    cloud.fail_next(10, 403)
    with caplog.at_level(logging.INFO, logger="fleet.selfdelete"):
        _delete(metadata, compute_clients)
    assert len(cloud.calls()) == 1  # permission denied is not worth a retry
    failed = [r.getMessage() for r in caplog.records if "event=self_delete_failed" in r.getMessage()]
    assert len(failed) == 1 and "error_type=Forbidden" in failed[0] and "403" in failed[0]
    assert poweroff.calls() == [["systemctl", "poweroff"]]


def test_machine_without_systemctl_shuts_down_instead(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, compute_clients, poweroff: StubBin
):
    (poweroff.dir / "systemctl").unlink()
    metadata_server.values.update(gce_vm(PROJECT, ZONE, "solo"))  # the instance does not exist: 404
    _delete(metadata, compute_clients)
    assert poweroff.calls() == [["shutdown", "-h", "now"]]


def test_unreachable_metadata_server_powers_off(poweroff: StubBin, caplog: pytest.LogCaptureFixture):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with caplog.at_level(logging.INFO, logger="fleet.selfdelete"):
        _delete(MetadataClient(f"127.0.0.1:{port}", timeout_s=0.5))
    assert any("event=self_delete_failed error_type=ConnectionError" in r.getMessage() for r in caplog.records)
    assert poweroff.calls() == [["systemctl", "poweroff"]]


def test_group_member_that_cannot_delete_itself_stays_up_instead_of_powering_off_into_a_repair_loop(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, compute_clients, poweroff: StubBin,
    caplog: pytest.LogCaptureFixture,
):
    metadata_server.values.update(gce_vm(PROJECT, ZONE, "spawn-worker-q1", {"created-by": f"projects/1/zones/{ZONE}/instanceGroupManagers/spawn-worker"}))
    cloud.fail_next(10, 403)
    with caplog.at_level(logging.INFO, logger="fleet.selfdelete"):
        accepted = delete_self(metadata, compute_clients=compute_clients, attempts=2, max_wait_s=0.05)
    assert accepted is False
    assert poweroff.calls() == []
    assert any("action=stay_up" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "values, held, missing",
    [
        (gce_vm(PROJECT, ZONE, "m1", {"created-by": f"projects/1/zones/{ZONE}/instanceGroupManagers/g"}),
         {"compute.instances.delete"}, "compute.instanceGroupManagers.update"),
        (gce_vm(PROJECT, ZONE, "solo"), set(), "compute.instances.delete"),
        (tpu_vm(PROJECT, "us-west4-a", "t-1", {"spawn-queued-resource": "t-1"}), {"tpu.nodes.get"}, "tpu.nodes.delete"),
        (tpu_vm(PROJECT, "us-west4-a", "t-2"), {"tpu.nodes.delete"}, "tpu.nodes.get"),
    ],
)
def test_boot_permission_check_names_the_missing_permission(
    metadata_server: FakeMetadata, cloud: FakeCloud, monkeypatch: pytest.MonkeyPatch, capsys, values, held, missing
):
    from fleet.selfdelete import main

    monkeypatch.setenv("FLEET_CRM_ENDPOINT", cloud.url)
    metadata_server.values.update(values)
    cloud.held_permissions = held
    assert main(["check"]) == 3
    out = capsys.readouterr().out
    assert out.startswith("missing_permission: ") and missing in out and PROJECT in out
    [call] = cloud.calls()
    assert call.path == f"/v1/projects/{PROJECT}:testIamPermissions"


def test_boot_permission_check_passes_when_every_permission_is_held(
    metadata_server: FakeMetadata, cloud: FakeCloud, monkeypatch: pytest.MonkeyPatch
):
    from fleet.selfdelete import main

    monkeypatch.setenv("FLEET_CRM_ENDPOINT", cloud.url)
    metadata_server.values.update(gce_vm(PROJECT, ZONE, "m1", {"created-by": f"projects/1/zones/{ZONE}/instanceGroupManagers/g"}))
    cloud.held_permissions = {"compute.instanceGroupManagers.update"}
    assert main(["check"]) == 0


def test_queued_resource_attribute_name_matches_the_specs():
    from fleet import selfdelete, specs

    assert selfdelete.ATTR_QUEUED_RESOURCE == specs.ATTR_QUEUED_RESOURCE


def test_permission_check_does_not_import_the_compute_client():
    # The boot runs it before every start; compute_v1's import alone costs seconds of CPU.
    import subprocess
    import sys

    code = "import sys, fleet.selfdelete; print('google.cloud.compute_v1' in sys.modules, 'google.cloud.tpu_v2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert out.stdout.split() == ["False", "False"]


def test_boot_permission_check_asks_only_permissions_google_documents():
    # roles/tpu.admin (https://cloud.google.com/iam/docs/roles-permissions/tpu) lists tpu.nodes.*, and no
    # queued-resource permission; Compute's are on the method pages (docs/CLOUD.md, "Self-deletion").
    from fleet.selfdelete import PERMISSIONS

    documented = {"compute.instanceGroupManagers.update", "compute.instances.delete", "tpu.nodes.get", "tpu.nodes.delete"}
    assert {p for wanted in PERMISSIONS.values() for p in wanted} <= documented


def _check_in_a_queued_tpu(metadata_server: FakeMetadata, cloud: FakeCloud, monkeypatch: pytest.MonkeyPatch, capsys):
    from fleet.selfdelete import main

    monkeypatch.setenv("FLEET_CRM_ENDPOINT", cloud.url)
    metadata_server.values.update(tpu_vm(PROJECT, "us-west4-a", "t-3", {"spawn-queued-resource": "t-3"}))
    status = main(["check"])
    return status, capsys.readouterr().out


@pytest.mark.parametrize("status", [400, 403, 404])
def test_a_permission_check_answered_with_an_error_is_unverified_and_the_worker_goes_on(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, monkeypatch: pytest.MonkeyPatch, capsys,
    state_dir, status: int,
):
    # 400: what testIamPermissions answers for a permission it does not know; 403/404: the API is off,
    # or the scope does not cover it. None of them says the delete would fail.
    from fleet.machines import machine_identity

    cloud.fail_next(1, status, path_contains=":testIamPermissions")
    exit_status, out = _check_in_a_queued_tpu(metadata_server, cloud, monkeypatch, capsys)
    assert exit_status == 0
    assert out.startswith("unverified: tpu_queued_resource (cannot check tpu.nodes.delete on project proj-a") and str(status) in out
    assert len(cloud.calls(contains=":testIamPermissions")) == 1  # not worth a retry
    # The worker's records carry the verdict from then on.
    identity = machine_identity(metadata)
    assert identity["permissions"] == "unverified" and str(status) in identity["permissions_detail"]


def test_a_permission_check_that_keeps_failing_is_retried_then_unverified(
    metadata_server: FakeMetadata, metadata: MetadataClient, cloud: FakeCloud, monkeypatch: pytest.MonkeyPatch
):
    from fleet import iam
    from fleet.selfdelete import check_permissions

    metadata_server.values.update(gce_vm(PROJECT, ZONE, "solo"))
    cloud.fail_next(10, 503, path_contains=":testIamPermissions")
    verdict = check_permissions(metadata, iam.ResourceManager(cloud.url), attempts=3, max_wait_s=0.01)
    assert (verdict.kind, verdict.outcome) == ("instance", "unverified") and "503" in verdict.detail
    assert len(cloud.calls(contains=":testIamPermissions")) == 3


class _OddResourceManager(FakeCloud):
    """A Resource Manager whose testIamPermissions answers `answer` (raw bytes), whatever was asked."""

    answer = b""

    def handle(self, request):
        from tests.cloud.fakehttp import Response

        if request.path.endswith(":testIamPermissions"):
            return Response(200, self.answer, {"Content-Type": "application/json"})
        return super().handle(request)


@pytest.mark.parametrize("answer", [
    b'{"permissions": ["tpu.nodes.delete", "tpu.queuedResources.delete"]}',  # one it was not asked about
    b'{"permissions": "tpu.nodes.delete"}',
    b"<html>a proxy's page</html>",
])
def test_a_permission_check_answer_outside_the_documented_shape_is_unverified(
    metadata_server: FakeMetadata, monkeypatch: pytest.MonkeyPatch, capsys, state_dir, answer: bytes
):
    import json

    server = _OddResourceManager().start()
    server.answer = answer
    try:
        exit_status, out = _check_in_a_queued_tpu(metadata_server, server, monkeypatch, capsys)
    finally:
        server.stop()
    assert exit_status == 0 and out.startswith("unverified: tpu_queued_resource")
    assert json.loads((state_dir / "permission-check.json").read_text())["permissions"] == "unverified"


def test_a_granted_check_is_recorded_as_granted(
    metadata_server: FakeMetadata, cloud: FakeCloud, monkeypatch: pytest.MonkeyPatch, capsys, state_dir
):
    import json

    cloud.held_permissions = {"tpu.nodes.delete"}
    exit_status, out = _check_in_a_queued_tpu(metadata_server, cloud, monkeypatch, capsys)
    assert (exit_status, out.strip()) == (0, "granted: tpu_queued_resource")
    [call] = cloud.calls()
    assert call.body == {"permissions": ["tpu.nodes.delete"]}
    assert json.loads((state_dir / "permission-check.json").read_text())["permissions"] == "granted"
