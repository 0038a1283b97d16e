"""fleet.keeper and tools/fleetctl.py keep against the fake TPU API: a preempted spot TPU (its queued
resource SUSPENDED) is deleted and replaced, a refusing zone falls back to the next, and a
drained queue stops the keeper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import keeper, specs
from objectstore import open_store
from taskqueue.submit import submit
from tests.cloud.fakecloud import FakeCloud

REPO = Path(__file__).resolve().parents[2]
TPU_SPEC = REPO / "templates" / "tpu.yaml"
PROJECT = "proj-k"
ZONE_A, ZONE_B = "us-west4-a", "us-east5-b"


def _qr(zone: str, rid: str) -> str:
    return f"projects/{PROJECT}/locations/{zone}/queuedResources/{rid}"


def _keeper(tpu_clients, count: int, pending: list[int], zones=(ZONE_A, ZONE_B)) -> keeper.Keeper:
    spec = specs.load_spec(TPU_SPEC)
    launch = specs.Launch.make(spec, "gs://bkt/jobs/j", "gs://bkt/code/c")
    return keeper.Keeper(tpu_clients, spec, launch, PROJECT, list(zones), count, lambda: pending[0])


def test_keeper_replaces_a_suspended_tpu_while_work_is_pending(cloud: FakeCloud, tpu_clients):
    pending = [10]
    fleet_keeper = _keeper(tpu_clients, 2, pending)
    first = fleet_keeper.step()
    assert first.created == [f"{ZONE_A}/spawn-tpu-0000", f"{ZONE_A}/spawn-tpu-0001"]
    assert fleet_keeper.step().created == []  # both ACTIVE: nothing to do

    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0000"), "SUSPENDED")  # preempted
    report = fleet_keeper.step()
    assert report.deleted == ["spawn-tpu-0000"]
    assert report.created == [f"{ZONE_A}/spawn-tpu-0002"]
    assert _qr(ZONE_A, "spawn-tpu-0000") not in cloud.resources
    deletes = [c for c in cloud.calls("DELETE")]
    assert [(c.path, c.query.get("force")) for c in deletes] == [(f"/v2/{_qr(ZONE_A, 'spawn-tpu-0000')}", "true")]
    created = cloud.resources[_qr(ZONE_A, "spawn-tpu-0002")]
    node = created["tpu"]["nodeSpec"][0]
    assert node["nodeId"] == "spawn-tpu-0002" and node["node"]["metadata"]["spawn-queued-resource"] == "spawn-tpu-0002"
    assert "spot" in created


def test_keeper_falls_back_to_the_next_zone_when_one_refuses(cloud: FakeCloud, tpu_clients):
    cloud.fail_next(1, 429, method="POST", path_contains=f"locations/{ZONE_A}/queuedResources")
    report = _keeper(tpu_clients, 1, [3]).step()
    assert report.created == [f"{ZONE_B}/spawn-tpu-0000"]
    assert len(report.refused) == 1 and report.refused[0].startswith(f"{ZONE_A}: ")
    assert _qr(ZONE_B, "spawn-tpu-0000") in cloud.resources


def test_keeper_moves_away_from_a_zone_whose_resource_failed(cloud: FakeCloud, tpu_clients):
    fleet_keeper = _keeper(tpu_clients, 1, [5])
    fleet_keeper.step()
    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0000"), "FAILED")
    report = fleet_keeper.step()
    assert report.deleted == ["spawn-tpu-0000"] and report.created == [f"{ZONE_B}/spawn-tpu-0001"]


def test_keeper_stops_when_the_queue_is_drained_and_creates_nothing(cloud: FakeCloud, tpu_clients):
    pending = [1]
    fleet_keeper = _keeper(tpu_clients, 2, pending)
    fleet_keeper.step()
    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0001"), "SUSPENDED")
    pending[0] = 0
    before = len(cloud.calls())
    report = fleet_keeper.run(interval_s=0, max_steps=5)
    assert report.drained and report.created == [] and report.deleted == []
    assert len(cloud.calls()) == before  # not even a listing


def test_fleet_keep_tool_dry_run_prints_the_replacement_and_sends_nothing(cloud: FakeCloud, tpu_clients, gcs_bucket: str, gcs_client):
    queue = f"gs://{gcs_bucket}/jobs/j"
    submit(open_store(queue), None, [("t1", json.dumps({"id": "t1"}).encode())])
    fleet_keeper = _keeper(tpu_clients, 1, [1])
    fleet_keeper.step()
    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0000"), "SUSPENDED")
    mutations = len(cloud.mutations())
    result = subprocess.run(
        [sys.executable, "tools/fleetctl.py", "keep", str(TPU_SPEC), "--count", "1", "--zone", ZONE_A, "--queue", queue,
         "--code", "gs://bkt/code/c", "--project", PROJECT, "--once", "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert len(cloud.mutations()) == mutations
    assert '"request": "DeleteQueuedResourceRequest"' in result.stdout
    assert '"request": "CreateQueuedResourceRequest"' in result.stdout and "spawn-tpu-0001" in result.stdout
    assert "pending=1 alive=0 deleted=1 created=1" in result.stdout


def test_keeper_refuses_plain_node_specs(tmp_path: Path):
    spec = specs.parse_spec({**__import__("yaml").safe_load(TPU_SPEC.read_text()), "queued": False}, "x.yaml")
    with pytest.raises(keeper.KeeperError, match="queued: false"):
        keeper.Keeper(None, spec, specs.Launch.make(spec, "gs://b/q", "gs://b/c"), PROJECT, [ZONE_A], 1, lambda: 1)
