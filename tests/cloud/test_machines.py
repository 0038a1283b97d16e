"""fleet.machines: the records a fleet writes and the fleet section of tools/status.py, from one
listing of machines/ (custom metadata carries what status shows)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import machines
from objectstore import open_store

REPO = Path(__file__).resolve().parents[2]


def test_fleet_snapshot_counts_groups_failures_finds_silent_machines_and_tasks(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    for name, state, fields in [
        ("w-1", "working", {"task": "t7"}),
        ("w-2", "working", {"task": "t9"}),
        ("w-3", "idle", {}),
        ("w-4", "failed", {"reason": "install_failed: exit 1 at line 300", "log_tail": "pip says no"}),
        ("w-5", "failed", {"reason": "install_failed: exit 1 at line 300"}),
        ("w-6", "failed", {"reason": "missing_permission: compute.instances.delete on project p"}),
        ("w-7", "deleting", {}),
    ]:
        machines.write_record(store, machines.make_record(name, state, accelerator="gpu", code="gs://b/code/v1", **fields))
    # Everything was written just now; seen 10 minutes later with 60 s beats, the live ones are silent.
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=10)
    view = machines.fleet_snapshot(store, now=later, beat_s=60)
    assert view["machines"] == 7
    assert view["by_state"] == {"deleting": 1, "failed": 3, "idle": 1, "working": 2}
    assert view["failures"] == {
        "install_failed: exit 1 at line 300": ["w-4", "w-5"],
        "missing_permission: compute.instances.delete on project p": ["w-6"],
    }
    assert view["silent"] == ["w-1", "w-2", "w-3"]
    assert view["working"] == {"w-1": "t7", "w-2": "t9"}
    fresh = machines.fleet_snapshot(store, beat_s=60)
    assert fresh["silent"] == []
    text = machines.render_fleet(view)
    assert "failed x2: install_failed" in text and "w-1: working on t7" in text and "silent > 180s: w-1, w-2, w-3" in text
    # The log tail stays in the body, out of the listing.
    assert json.loads(store.read("machines/w-4.json").data)["log_tail"] == "pip says no"


def test_recorder_refreshes_its_record_every_beat_and_stops_after_a_final_state(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    recorder = machines.MachineRecorder(store, "w-9", beat_s=0.05, accelerator="cpu").start()
    recorder.set("working", task="t1")
    first = store.read("machines/w-9.json").generation
    import time

    time.sleep(0.3)
    assert store.read("machines/w-9.json").generation > first + 1
    recorder.set("exited", reason="drained")
    final = store.read("machines/w-9.json")
    time.sleep(0.2)
    assert store.read("machines/w-9.json").generation == final.generation
    assert json.loads(final.data)["state"] == "exited"


def test_bad_state_is_refused_naming_the_states():
    with pytest.raises(machines.MachineRecordError, match="must be one of booting"):
        machines.make_record("w", "sleeping")


def test_status_tool_shows_the_fleet_and_keeps_json(tmp_path: Path):
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    machines.write_record(store, machines.make_record("w-1", "failed", reason="bad_attribute: spawn-code="))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "tools/status.py", str(queue), "--json"], cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["fleet"]["failures"] == {"bad_attribute: spawn-code=": ["w-1"]}
    text = subprocess.run([sys.executable, "tools/status.py", str(queue)], cwd=REPO, capture_output=True, text=True, env=env)
    assert "fleet: 1 machines  failed=1" in text.stdout


def test_attribute_names_match_the_specs():
    from fleet import specs

    assert (machines.ATTR_ACCELERATOR, machines.ATTR_CODE) == (specs.ATTR_ACCELERATOR, specs.ATTR_CODE)
