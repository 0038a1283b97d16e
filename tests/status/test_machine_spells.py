"""The machine record's time accounting: the worker carries on the spells startup.sh began in the same
boot, ends a spell on every change, and a listing alone gives the seconds per state."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from fleet import machines
from reporting.cost import fleet_cost, machine_seconds
from reporting.machinestate import BOOT_STUCK_S, classify, read_row
from reporting.pricing import load_prices
from objectstore import open_store


def test_worker_carries_on_this_boots_spells_and_starts_afresh_after_another_boot(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    boot = now - dt.timedelta(seconds=400)
    # What startup.sh leaves: booted 400 s ago, booting for 100 s, installing since 300 s ago.
    machines.write_record(store, machines.make_record(
        "vm-1", "installing", at=now - dt.timedelta(seconds=300), since=(now - dt.timedelta(seconds=300)).isoformat(),
        spent={"booting": 100}, boot_at=boot.isoformat(), machine_type="g2-standard-8", provisioning="spot"))  # fmt: skip
    recorder = machines.MachineRecorder(store, "vm-1", machine_type="g2-standard-8", provisioning="spot")
    recorder.carry_on(boot)
    recorder.set("working", task="t1")
    body = json.loads(store.read("machines/vm-1.json").data)
    assert body["spent"]["booting"] == 100 and 299 <= body["spent"]["installing"] <= 302
    [entry] = store.list("machines/")
    assert entry.metadata["spent_booting"] == "100" and entry.metadata["boot_at"] == boot.isoformat()
    row = read_row(entry, now)
    seconds = machine_seconds(row, now + dt.timedelta(seconds=60))
    assert seconds["booting"] == 100 and 299 <= seconds["installing"] <= 302 and 59 <= seconds["working"] <= 62

    other = machines.MachineRecorder(store, "vm-1")
    other.carry_on(boot + dt.timedelta(hours=1))  # a later boot of a machine with the same name
    other.set("idle")
    assert json.loads(store.read("machines/vm-1.json").data)["spent"] == {}


def test_failed_boot_counts_as_failed_and_silent_and_lost_machines_are_priced_while_they_may_run(tmp_path: Path):
    """A final record ends the bill at that record; a silent machine is billed to now; a lost one until
    it was declared lost (its last record + 3 beats), the last moment its records said it might run."""
    store = open_store(str(tmp_path / "queue"))
    now = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
    machines.write_record(store, machines.make_record("f", "failed", at=now, since=now.isoformat(),
                                                      spent={"booting": 30, "installing": 90}))  # fmt: skip
    last = now - dt.timedelta(seconds=900)
    machines.write_record(store, machines.make_record("lost", "working", at=last, since=(last - dt.timedelta(seconds=50)).isoformat(),
                                                      spent={"idle": 5}, beat_s=60.0))  # fmt: skip
    quiet = now - dt.timedelta(seconds=100)
    machines.write_record(store, machines.make_record("silent", "idle", at=quiet, since=(quiet - dt.timedelta(seconds=20)).isoformat(),
                                                      beat_s=60.0))  # fmt: skip
    rows = {e.name: read_row(e, now) for e in store.list("machines/")}
    assert [classify(rows[f"machines/{m}.json"]) for m in ("f", "lost", "silent")] == ["failed", "lost", "silent"]
    assert machine_seconds(rows["machines/f.json"], now) == {"booting": 0, "installing": 0, "working": 0, "idle": 0, "failed": 120}
    assert machine_seconds(rows["machines/lost.json"], now) == {"booting": 0, "installing": 0, "working": 50 + 180, "idle": 5, "failed": 0}
    assert machine_seconds(rows["machines/silent.json"], now) == {"booting": 0, "installing": 0, "working": 0, "idle": 120, "failed": 0}


def test_a_boot_record_45_minutes_old_is_lost_and_priced_for_the_30_minutes_it_may_have_run(tmp_path: Path):
    """The defect: a machine whose boot record was 45 minutes old showed lost and priced $0, its time
    stopping at the boot record. Nothing says it stopped before it was declared lost (30 minutes
    without a new boot record), so those 30 minutes are billed: all of it boot time, all waste."""
    url = str(tmp_path / "queue")
    store = open_store(url)
    now = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
    booted = now - dt.timedelta(minutes=45)
    machines.write_record(store, machines.make_record("vm-stuck", "booting", at=booted, since=booted.isoformat(), spent={},
                                                      machine_type="n2-standard-8", provisioning="spot"))  # fmt: skip
    [row] = [read_row(e, now) for e in store.list("machines/")]
    assert classify(row) == "lost"
    assert machine_seconds(row, now)["booting"] == BOOT_STUCK_S == 1800
    prices = load_prices()
    cost = fleet_cost([row], prices, now)
    per_hour = prices.machine_price("n2-standard-8").spot_per_hour
    assert cost["total_dollars"] == cost["waste_dollars"] == round(per_hour / 2, 4) > 0
    assert cost["burn_per_hour"] == 0  # not up: it burns nothing more in the projection


@pytest.mark.parametrize(
    "scheduling, expected",
    [({"instance/scheduling/provisioning-model": "SPOT"}, "spot"),
     ({"instance/scheduling/provisioning-model": "STANDARD", "instance/scheduling/preemptible": "FALSE"}, "standard"),
     ({"instance/scheduling/preemptible": "TRUE"}, "spot"),  # an older preemptible VM, no provisioning-model key
     ({}, "standard")],
)  # fmt: skip
def test_identity_reads_the_priced_type_and_provisioning_model_from_the_metadata_server(scheduling, expected):
    from fleet.metadata import MetadataClient
    from tests.cloud.fakemetadata import FakeMetadata, gce_vm, tpu_vm

    server = FakeMetadata().start()
    try:
        server.values.update(gce_vm("p", "us-central1-a", "w-1"))
        server.values.update({"instance/machine-type": "projects/123/machineTypes/g2-standard-8", **scheduling})
        identity = machines.machine_identity(MetadataClient(server.host))
        assert (identity["machine_type"], identity["provisioning"], identity["host"]) == ("g2-standard-8", expected, None)
        server.values.clear()
        server.values.update(tpu_vm("p", "us-west4-a", "node-1", {"accelerator-type": "v5litepod-8"}))
        server.values.update(scheduling)
        identity = machines.machine_identity(MetadataClient(server.host))
        assert (identity["name"], identity["machine_type"], identity["provisioning"], identity["host"]) == (
            "node-1", "v5litepod-8", expected, "0")  # fmt: skip
    finally:
        server.stop()


def test_back_to_back_tasks_wait_for_the_beat_and_the_seconds_stay_exact(tmp_path: Path):
    """A working/idle change after the first write is published by the next beat, not at once; the
    spells are kept in memory, so the record's seconds add up to the machine's time all the same."""
    store = open_store(str(tmp_path / "queue"))
    start = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
    clock = [start]
    at = lambda s: start + dt.timedelta(seconds=s)  # noqa: E731
    recorder = machines.MachineRecorder(store, "vm-2", beat_s=60, now=lambda: clock[0], machine_type="e2-standard-4")
    seen = []  # the record as stored: after each minute's changes, and after each beat

    def record() -> dict:
        return json.loads(store.read("machines/vm-2.json").data)

    def minute(stop, seconds):
        """The beat's sleep: what the worker does in this minute, then the clock moves on."""
        if seen:
            seen.append(record())  # what the previous beat wrote
        if not seen:
            for second, state, fields in [(5, "working", {"task": "t1"}), (50, "idle", {}), (52, "working", {"task": "t2"})]:
                clock[0] = at(second)
                recorder.set(state, **fields)
            seen.append(record())
            clock[0] = at(60)
        else:
            clock[0] = at(100)
            recorder.set("exited", reason="drained")
        return stop.is_set()

    recorder.wait = minute
    recorder.set("idle")  # the first state: written at once
    recorder.beat_loop()
    assert recorder.writes == {"change": 3, "deferred": 2, "beat": 1}
    # Three changes in the first minute: the claim written at once (the record said idle), the idle
    # after it and the next claim back to back left to the beat.
    assert (seen[0]["state"], seen[0]["task"]) == ("working", "t1")
    assert (seen[1]["state"], seen[1]["task"], seen[1]["since"], seen[1]["spent"]) == (
        "working", "t2", at(52).isoformat(), {"idle": 7, "working": 45})  # the beat wrote the last of them
    final = json.loads(store.read("machines/vm-2.json").data)
    assert final["state"] == "exited" and final["spent"] == {"idle": 7, "working": 93}
    [entry] = store.list("machines/")
    row = read_row(entry, at(100))
    assert sum(machine_seconds(row, at(100)).values()) == 100
