"""The worker side on a machine: fleet.service turns metadata into spawn.py's argv without a shell,
and a real spawn.py worker hands its task back within 10 s of a preemption notice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet.metadata import MetadataClient
from fleet.service import ServiceConfigError, worker_argv
from objectstore import NotFound, open_store
from taskqueue.submit import submit
from tests.cloud.fakemetadata import FakeMetadata, gce_vm

REPO = Path(__file__).resolve().parents[2]


def test_worker_argv_comes_from_metadata_and_no_value_is_run_as_code(metadata_server: FakeMetadata, metadata: MetadataClient):
    metadata_server.values.update(gce_vm("p", "z", "w", {
        "spawn-queue": "gs://bkt/jobs/j1",
        "spawn-consumer": "python consume.py --note '$(touch /tmp/pwned)'",
        "spawn-flags": "--on-empty delete --log-level 'DEBUG; reboot'",
    }))
    argv = worker_argv(metadata, python="/opt/fleet/venv/bin/python")
    assert argv == [
        "/opt/fleet/venv/bin/python", str(REPO / "spawn.py"), "gs://bkt/jobs/j1",
        "--consumer", "python consume.py --note '$(touch /tmp/pwned)'",
        "--on-empty", "delete", "--log-level", "DEBUG; reboot",
    ]


def test_worker_argv_names_a_missing_attribute(metadata_server: FakeMetadata, metadata: MetadataClient):
    metadata_server.values.update(gce_vm("p", "z", "w", {"spawn-consumer": "python consume.py"}))
    with pytest.raises(ServiceConfigError, match="'spawn-queue' is not set"):
        worker_argv(metadata)


def _lease(store, task: str) -> dict | None:
    try:
        return json.loads(store.read(f"leases/{task}.json").data)
    except NotFound:
        return None


def _wait_for(what: str, check, timeout_s: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"spawn.py exited ({proc.returncode}) while waiting for {what}:\n{proc.stdout.read()}")
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def _spawn(queue: Path, *flags: str, env: dict | None = None) -> subprocess.Popen:
    consumer = f"{sys.executable} {REPO / 'tests' / 'queue' / 'consumer.py'}"
    return subprocess.Popen(
        [sys.executable, "spawn.py", str(queue), "--consumer", consumer, "--lease-ttl", "60", "--heartbeat", "0.3",
         "--idle-timeout", "1", "--poll", "0.1", *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )


def test_preempted_worker_releases_its_lease_within_10_s_and_the_attempt_is_not_counted(
    tmp_path: Path, metadata_server: FakeMetadata
):
    metadata_server.values.update(gce_vm("p", "us-central1-a", "w-1"))
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    submit(store, b"{}", [("t1", json.dumps({"id": "t1", "outputs": 12, "sleep": 0.3}).encode())])

    worker = _spawn(queue, "--worker-id", "w-preempted", "--preemption-watch", "on")
    try:
        _wait_for("two committed outputs", lambda: len((_lease(store, "t1") or {}).get("progress", [])) >= 2, 60, worker)
        flipped = time.monotonic()
        metadata_server.set("instance/preempted", "TRUE")
        released = _wait_for("the lease to be released", lambda: (_lease(store, "t1") or {}).get("state") == "released" and _lease(store, "t1"), 10)
        assert time.monotonic() - flipped < 10
        assert worker.wait(timeout=15) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    output = worker.stdout.read()
    assert "event=preempted key=instance/preempted" in output
    assert released["errors"] == []
    committed = len(released["progress"])
    assert 2 <= committed < 12

    # The next worker resumes from the committed outputs; the preemption cost no attempt.
    successor = _spawn(queue, "--worker-id", "w-next", "--preemption-watch", "off")
    assert successor.wait(timeout=60) == 0, successor.stdout.read()
    done = json.loads(store.read("done/t1.json").data)
    assert done["attempt"] == 1
    assert [r["index"] for r in done["outputs"]] == list(range(12))


def test_maintenance_notice_keeps_the_worker_going_until_sigterm_then_it_releases_its_lease(
    tmp_path: Path, metadata_server: FakeMetadata
):
    metadata_server.values.update(gce_vm("p", "us-central1-a", "gpu-1", {"spawn-accelerator": "gpu"}))
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    submit(store, b"{}", [("t1", json.dumps({"id": "t1", "outputs": 200, "sleep": 0.1}).encode())])

    worker = _spawn(queue, "--worker-id", "w-maint", "--preemption-watch", "on")
    try:
        _wait_for("two committed outputs", lambda: len((_lease(store, "t1") or {}).get("progress", [])) >= 2, 60, worker)
        metadata_server.set("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        at_notice = len(_lease(store, "t1")["progress"])
        # An hour's notice is not a stop: the worker keeps committing outputs under the same lease.
        _wait_for("more outputs after the notice", lambda: len(_lease(store, "t1")["progress"]) >= at_notice + 3, 30, worker)
        assert _lease(store, "t1")["state"] != "released"
        assert worker.poll() is None
        signalled = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        released = _wait_for("the lease to be released", lambda: (_lease(store, "t1") or {}).get("state") == "released" and _lease(store, "t1"), 10)
        assert time.monotonic() - signalled < 10
        assert worker.wait(timeout=15) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    output = worker.stdout.read()
    assert "event=maintenance_notice value=TERMINATE_ON_HOST_MAINTENANCE" in output
    assert "event=preempted" not in output
    assert released["errors"] == []
    assert at_notice + 3 <= len(released["progress"]) < 200


def test_a_queue_that_finished_with_dead_letters_is_no_clean_finish_for_the_worker_status_or_down(
    tmp_path: Path, metadata_server: FakeMetadata
):
    """Both tasks exit 65 (bad input): the queue finishes, 0 of 2 done, 2 dead letters. The worker
    still stops (nothing is left to run) and status is still `complete` (the keeper stops on it), but
    the worker's last record, status's text and `down` all say it is not a clean finish (issue 48)."""
    from gcs_spawner.down import Declined, _confirm_incomplete
    from reporting.status import render, snapshot

    metadata_server.values.update(gce_vm("p", "us-central1-a", "w-8"))
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    submit(store, b"{}", [(t, json.dumps({"id": t, "exit": 65}).encode()) for t in ("t1", "t2")])
    worker = _spawn(queue, "--worker-id", "w-8-worker", "--preemption-watch", "off", "--machine-record", "auto")
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output
    record = json.loads(store.read("machines/w-8.json").data)
    assert record["state"] == "exited", record
    assert record["reason"] == f"drained with 2 dead letters (gcs-spawner status {store.root_url} --machines lists them)"
    view = snapshot(store)
    assert (view["complete"], view["done"], view["failed"]) == (True, 0, 2)
    text = render(view)
    assert "finished: 0 done, 2 dead letters" in text and "--machines" in text
    assert "complete: every task" not in text
    with pytest.raises(Declined, match="finished with dead letters"):
        _confirm_incomplete(store, [], confirm=None)
    asked: list[str] = []
    with pytest.raises(Declined):
        _confirm_incomplete(store, [], confirm=lambda question: asked.append(question) or False)
    assert "0 of 2 tasks done, 2 failed" in asked[0]


def test_worker_writes_its_machine_record_on_each_state_change(tmp_path: Path, metadata_server: FakeMetadata):
    metadata_server.values.update(gce_vm("p", "us-central1-a", "w-7", {"spawn-accelerator": "cpu", "spawn-code": "gs://b/code/v3"}))
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    submit(store, b"{}", [(t, json.dumps({"id": t, "outputs": 2, "sleep": 1.0}).encode()) for t in ("t1", "t2")])

    # The first state and the final one are written at once; working/idle changes go out with the
    # beat (docs/PROTOCOL.md, "Machine records"), here every 0.2 s, so each task of a second shows.
    worker = _spawn(queue, "--worker-id", "w-7-worker", "--preemption-watch", "off", "--machine-record", "auto",
                    env={"SPAWN_MACHINE_BEAT_S": "0.2"})  # fmt: skip
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output
    states = [line.split("state=")[1].split()[0] for line in output.splitlines() if "event=machine_record " in line]
    assert states[0] == "idle" and states[-1] == "exited"
    assert "event=machine_record machine=w-7 state=working task=t1" in output
    assert "event=machine_record machine=w-7 state=working task=t2" in output
    record = json.loads(store.read("machines/w-7.json").data)
    assert record["state"] == "exited" and record["reason"] == "drained"
    assert (record["machine"], record["zone"], record["accelerator"], record["code"]) == ("w-7", "us-central1-a", "cpu", "gs://b/code/v3")
    [entry] = list(store.list("machines/"))
    assert entry.metadata["state"] == "exited" and entry.metadata["code"] == "gs://b/code/v3"


def test_group_whose_queue_is_drained_ends_at_size_zero(tmp_path: Path, metadata_server: FakeMetadata, cloud):
    """Each member finds the queue drained, records `deleting` and leaves its group through
    deleteInstances, which lowers the target size: the group is not told to recreate anyone."""
    group = "projects/p/zones/us-central1-a/instanceGroupManagers/spawn-worker"
    cloud.add(group, {"name": "spawn-worker", "targetSize": 2})
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    submit(store, b"{}", [("t1", json.dumps({"id": "t1"}).encode())])
    for member in ("spawn-worker-a1b2", "spawn-worker-c3d4"):
        cloud.add(f"projects/p/zones/us-central1-a/instances/{member}", {"name": member})
        metadata_server.values.clear()
        metadata_server.values.update(gce_vm("p", "us-central1-a", member, {"created-by": f"projects/1/zones/us-central1-a/instanceGroupManagers/spawn-worker"}))
        worker = _spawn(queue, "--on-empty", "delete", "--preemption-watch", "off")
        output, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0, output
        assert json.loads(store.read(f"machines/{member}.json").data)["state"] == "deleting"
    assert cloud.resources[group]["targetSize"] == 0
    calls = [(c.method, c.path) for c in cloud.calls() if c.method == "POST"]
    assert calls == [("POST", f"/compute/v1/{group}/deleteInstances")] * 2
    assert not [k for k in cloud.resources if "/instances/" in k]


def test_a_member_pointed_at_a_prefix_with_no_job_records_why_and_leaves_its_group(tmp_path: Path, metadata_server: FakeMetadata, cloud):
    """A typo in the queue prefix (jobs/j1x for jobs/j1): the member never reports drained, writes no
    queue object there, records `failed` naming the URL, and leaves its group (billing stops)."""
    group = "projects/p/zones/us-central1-a/instanceGroupManagers/spawn-worker"
    cloud.add(group, {"name": "spawn-worker", "targetSize": 1})
    cloud.add("projects/p/zones/us-central1-a/instances/spawn-worker-e5f6", {"name": "spawn-worker-e5f6"})
    metadata_server.values.update(gce_vm("p", "us-central1-a", "spawn-worker-e5f6", {
        "created-by": "projects/1/zones/us-central1-a/instanceGroupManagers/spawn-worker"}))
    submit(open_store(str(tmp_path / "jobs" / "j1")), b"{}", [("t1", json.dumps({"id": "t1"}).encode())])
    typo = open_store(str(tmp_path / "jobs" / "j1x"))
    worker = _spawn(tmp_path / "jobs" / "j1x", "--on-empty", "delete", "--preemption-watch", "off", "--job-wait", "0.3")
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 65, output
    assert "reason=drained" not in output and "queue drained" not in output
    record = json.loads(typo.read("machines/spawn-worker-e5f6.json").data)
    assert record["state"] == "failed" and record["reason"].startswith(f"no job at {typo.root_url}: check the queue URL")
    assert [e.name for e in typo.list("")] == ["machines/spawn-worker-e5f6.json"]  # its record, nothing else
    assert [(c.method, c.path) for c in cloud.calls() if c.method == "POST"] == [("POST", f"/compute/v1/{group}/deleteInstances")]
    assert cloud.resources[group]["targetSize"] == 0


def test_a_member_whose_self_delete_fails_records_failed_not_deleting(tmp_path: Path, metadata_server: FakeMetadata, cloud):
    """A group member that cannot delete itself stays up (fleet/selfdelete.py: a group would recreate a
    stopped one): its record says why, not `deleting`, so status shows what still costs money."""
    group = "projects/p/zones/us-central1-a/instanceGroupManagers/spawn-worker"
    cloud.add(group, {"name": "spawn-worker", "targetSize": 1})
    metadata_server.values.update(gce_vm("p", "us-central1-a", "spawn-worker-g7h8", {
        "created-by": "projects/1/zones/us-central1-a/instanceGroupManagers/spawn-worker"}))
    cloud.fail_next(100, 403, path_contains="/deleteInstances")  # the role is missing
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    submit(store, b"{}", [("t1", json.dumps({"id": "t1"}).encode())])
    worker = _spawn(queue, "--on-empty", "delete", "--preemption-watch", "off")
    output, _ = worker.communicate(timeout=120)
    assert worker.returncode == 0, output
    assert "event=self_delete_failed" in output and "action=stay_up" in output
    record = json.loads(store.read("machines/spawn-worker-g7h8.json").data)
    assert record["state"] == "failed" and record["reason"].startswith("self_delete_failed: "), record
    assert output.index("state=deleting") < output.index("event=self_delete_failed") < output.index("state=failed")
