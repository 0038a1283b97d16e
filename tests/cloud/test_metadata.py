"""fleet.metadata and fleet.preemption against the fake metadata server."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from fleet import metadata as fleet_metadata
from fleet.metadata import MetadataClient, MetadataError
from fleet.preemption import PreemptionWatcher
from tests.cloud.fakemetadata import FakeMetadata, gce_vm


@pytest.fixture
def vm(metadata_server: FakeMetadata) -> FakeMetadata:
    metadata_server.values.update(gce_vm("proj-a", "us-central1-a", "worker-1", {"spawn-queue": "gs://b/jobs/j"}))
    return metadata_server


def test_on_gcp_is_true_when_metadata_host_answers(vm: FakeMetadata):
    assert fleet_metadata.on_gcp() is True
    assert all(r.headers.get("metadata-flavor") == "Google" for r in vm.requests)


def test_on_gcp_is_false_fast_when_nothing_answers(monkeypatch: pytest.MonkeyPatch):
    # A port nothing listens on: refused at once, so this also pins "fast".
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{port}")
    started = time.monotonic()
    assert fleet_metadata.on_gcp() is False
    assert time.monotonic() - started < 1.5


def test_server_without_flavor_header_is_not_a_metadata_server(monkeypatch: pytest.MonkeyPatch):
    from tests.cloud.fakehttp import FakeHTTPServer, Response

    class PlainWeb(FakeHTTPServer):
        def handle(self, request):
            return Response(200, b"hello")

    server = PlainWeb().start()
    try:
        with pytest.raises(MetadataError, match="Metadata-Flavor"):
            MetadataClient(server.host).text("instance/name")
    finally:
        server.stop()


def test_fake_refuses_requests_without_flavor_header(vm: FakeMetadata):
    resp = requests.get(f"{vm.url}/computeMetadata/v1/instance/name", timeout=5)
    assert resp.status_code == 403


def test_client_reads_text_attributes_and_recursive_json(vm: FakeMetadata, metadata: MetadataClient):
    assert metadata.text("instance/name") == "worker-1"
    assert metadata.attribute("spawn-queue") == "gs://b/jobs/j"
    assert metadata.attribute("not-set", "fallback") == "fallback"
    tree = metadata.json("instance/attributes/")
    assert tree == {"spawn-queue": "gs://b/jobs/j"}


def test_client_retries_a_metadata_server_5xx(vm: FakeMetadata, metadata: MetadataClient):
    vm.fail_next(2, 503)
    assert metadata.text("instance/name") == "worker-1"
    assert len(vm.requests) == 3


def test_wait_for_change_returns_when_the_value_flips(vm: FakeMetadata, metadata: MetadataClient):
    value, etag = metadata.current("instance/preempted")
    assert value == "FALSE"
    threading.Timer(0.3, vm.set, args=("instance/preempted", "TRUE")).start()
    started = time.monotonic()
    value, new_etag = metadata.wait_for_change("instance/preempted", etag, timeout_s=20)
    assert value == "TRUE" and new_etag != etag
    assert 0.2 < time.monotonic() - started < 5


def _watch(vm: FakeMetadata, **kw) -> tuple[PreemptionWatcher, threading.Event, list[float]]:
    fired = threading.Event()
    times: list[float] = []

    def on_preempted() -> None:
        times.append(time.monotonic())
        fired.set()

    watcher = PreemptionWatcher(on_preempted, metadata=MetadataClient(vm.host), poll_timeout_s=30, **kw).start()
    return watcher, fired, times


def _wait_for_long_polls(vm: FakeMetadata, count: int) -> None:
    deadline = time.monotonic() + 5
    while sum(r.query.get("wait_for_change") == "true" for r in vm.requests) < count:
        assert time.monotonic() < deadline, "the watcher never started its long polls"
        time.sleep(0.02)


def test_watcher_fires_once_promptly_when_preempted_turns_true(vm: FakeMetadata):
    watcher, fired, times = _watch(vm)
    try:
        _wait_for_long_polls(vm, 2)
        flipped = time.monotonic()
        vm.set("instance/preempted", "TRUE")
        assert fired.wait(5)
        assert times[0] - flipped < 1.0
        vm.set("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        time.sleep(0.3)  # a window in which a second firing would show: that none comes is the behaviour
        assert len(times) == 1
    finally:
        watcher.stop()


def test_terminate_maintenance_notice_is_reported_but_does_not_stop_the_worker(vm: FakeMetadata):
    notices: list[str] = []
    watcher, fired, times = _watch(vm, on_notice=notices.append)
    try:
        _wait_for_long_polls(vm, 2)
        vm.set("instance/maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
        vm.set("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        deadline = time.monotonic() + 5
        while "TERMINATE_ON_HOST_MAINTENANCE" not in notices:
            assert time.monotonic() < deadline, f"no notice reported, got {notices}"
            time.sleep(0.02)
        assert not fired.wait(0.5)
        # The watcher keeps watching: a later preemption still stops the worker.
        vm.set("instance/preempted", "TRUE")
        assert fired.wait(5)
        assert len(times) == 1
    finally:
        watcher.stop()


def test_watcher_reconnects_after_server_errors(vm: FakeMetadata):
    vm.fail_next(3, 503, path_contains="preempted")
    watcher, fired, _ = _watch(vm, keys=("instance/preempted",), min_backoff_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while not any(r.query.get("wait_for_change") == "true" for r in vm.requests):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        vm.set("instance/preempted", "TRUE")
        assert fired.wait(5)
    finally:
        watcher.stop()


def test_watcher_fires_at_once_when_already_preempted(vm: FakeMetadata):
    vm.set("instance/preempted", "TRUE")
    watcher, fired, _ = _watch(vm)
    try:
        assert fired.wait(5)
    finally:
        watcher.stop()


def test_stopped_watcher_never_calls_back(vm: FakeMetadata):
    watcher, fired, _ = _watch(vm)
    _wait_for_long_polls(vm, 2)
    watcher.stop(join_timeout_s=0.2)
    vm.set("instance/preempted", "TRUE")
    assert not fired.wait(0.5)
