"""fleet.machines: the records a fleet writes (the fleet section of tools/status.py that reads them:
tests/status/test_fleet_view.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from fleet import machines
from objectstore import open_store
from tests.workers import wait_for



def test_recorder_refreshes_its_record_every_beat_and_stops_after_a_final_state(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    recorder = machines.MachineRecorder(store, "w-9", beat_s=0.05, accelerator="cpu").start()
    recorder.set("working", task="t1")
    first = store.read("machines/w-9.json").generation
    wait_for(lambda: store.read("machines/w-9.json").generation > first + 1, 5, "two beats of the record")
    recorder.set("exited", reason="drained")
    final = store.read("machines/w-9.json")
    time.sleep(0.2)  # four beats' time in which nothing may be written: the behaviour under test
    assert store.read("machines/w-9.json").generation == final.generation
    assert json.loads(final.data)["state"] == "exited"


def test_a_claim_is_on_record_at_once_and_the_idle_after_it_waits_for_the_beat(tmp_path: Path):
    """A machine killed just after it claimed must not leave an `idle` record (issue 48): `working`
    is written at once when the record says anything else; `idle` after a task, and a next claim
    while the record already says `working`, wait for the beat (an hour here: never)."""
    store = open_store(str(tmp_path / "queue"))
    recorder = machines.MachineRecorder(store, "w-9", beat_s=3600, accelerator="cpu").start()

    def on_record() -> tuple[str, str | None]:
        body = json.loads(store.read("machines/w-9.json").data)
        return body["state"], body.get("task")

    recorder.set("idle")
    assert on_record() == ("idle", None)
    recorder.set("working", task="t1", attempt=1)
    assert on_record() == ("working", "t1")
    recorder.set("idle", last_task="t1")
    recorder.set("working", task="t2", attempt=1)
    assert on_record() == ("working", "t1")  # both left to the beat
    assert recorder.writes == {"change": 2, "deferred": 2}
    recorder.stop()


def test_bad_state_is_refused_naming_the_states():
    with pytest.raises(machines.MachineRecordError, match="must be one of booting"):
        machines.make_record("w", "sleeping")


def test_attribute_names_match_the_specs():
    from fleet import specs

    assert (machines.ATTR_ACCELERATOR, machines.ATTR_CODE) == (specs.ATTR_ACCELERATOR, specs.ATTR_CODE)
