"""The machine record's time accounting: the worker carries on the spells startup.sh began in the same
boot, ends a spell on every change, and a listing alone gives the seconds per state."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from fleet import machines
from fleet.cost import machine_seconds
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
    row = machines._row(entry, now)
    seconds = machine_seconds(row, now + dt.timedelta(seconds=60), silent_after_s=180)
    assert seconds["booting"] == 100 and 299 <= seconds["installing"] <= 302 and 59 <= seconds["working"] <= 62

    other = machines.MachineRecorder(store, "vm-1")
    other.carry_on(boot + dt.timedelta(hours=1))  # a later boot of a machine with the same name
    other.set("idle")
    assert json.loads(store.read("machines/vm-1.json").data)["spent"] == {}


def test_failed_boot_counts_as_failed_and_a_silent_machine_stops_at_its_last_record(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    now = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
    machines.write_record(store, machines.make_record("f", "failed", at=now, since=now.isoformat(),
                                                      spent={"booting": 30, "installing": 90}))  # fmt: skip
    last = now - dt.timedelta(seconds=900)
    machines.write_record(store, machines.make_record("s", "working", at=last, since=(last - dt.timedelta(seconds=50)).isoformat(),
                                                      spent={"idle": 5}))  # fmt: skip
    rows = {e.name: machines._row(e, now) for e in store.list("machines/")}
    assert machine_seconds(rows["machines/f.json"], now, 180) == {"booting": 0, "installing": 0, "working": 0, "idle": 0, "failed": 120}
    assert machine_seconds(rows["machines/s.json"], now, 180) == {"booting": 0, "installing": 0, "working": 50, "idle": 5, "failed": 0}


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
