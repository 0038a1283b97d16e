"""The run file, its record and the cloud agree (issue 47), against the fake GCS server and the fake Compute and TPU
APIs through the real clients: `up` after an edit prints the difference and applies exactly that (a resize, a
replace, TPU VMs added or removed), `--dry-run` prints the same and sends nothing, a change to what identifies the
run is refused; `down` finds by the run's label what the record does not list; a machine `down` deleted shows as
deleted; `keep` deletes lost machines the cloud still has; a zone or bucket that cannot work stops `up` first."""

from __future__ import annotations

import datetime as dt
import json

import yaml

from gcs_spawner.cli import main
from gcs_spawner.record import RunRecord
from tests.cli.conftest import PROJECT, REPO

GROUP = f"projects/{PROJECT}/zones/us-central1-a/instanceGroupManagers/r1"
TEMPLATE = f"projects/{PROJECT}/global/instanceTemplates/r1"


def up(run_file, *flags: str) -> int:
    return main(["up", str(run_file), "--yes", *flags])


def queued(zone: str, rid: str) -> str:
    return f"projects/{PROJECT}/locations/{zone}/queuedResources/{rid}"


def recorded_fleet(world) -> dict:
    return json.loads(world.store().read("run/run.json").data)["fleet"]


def test_a_count_edit_resizes_the_group_and_the_dry_run_shows_the_same_difference(world, capsys):
    run_file = world.run_file("vm")
    assert up(run_file) == 0
    assert recorded_fleet(world)["count"] == 2
    capsys.readouterr()

    world.run_file("vm", fleet={"count": 3})
    before = len(world.cloud.mutations())
    assert main(["up", str(run_file), "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert world.cloud.mutations()[before:] == []
    assert "  resize  instance_group r1 (us-central1-a): count 2 -> 3 (target size 2 -> 3)" in dry
    assert [line for line in dry.splitlines() if line.startswith("would send")] == [
        f"would send ResizeInstanceGroupManagerRequest size=3 zone=us-central1-a project={PROJECT} instance_group_manager=r1"]
    assert recorded_fleet(world)["count"] == 2  # a dry run records nothing

    assert up(run_file) == 0
    out = capsys.readouterr().out
    assert "  resize  instance_group r1 (us-central1-a): count 2 -> 3 (target size 2 -> 3)" in out
    assert "machines: resized instance_group r1 (us-central1-a) to 3" in out  # the step shows on a terminal
    assert [(m, p.rsplit("/", 2)[-2:]) for m, p in world.cloud.mutations()[before:]] == [
        ("POST", ["r1", "resize"])]
    assert world.cloud.resources[GROUP]["targetSize"] == 3
    assert recorded_fleet(world)["count"] == 3

    before = len(world.cloud.mutations())
    assert up(run_file) == 0  # converged: nothing more to send
    assert world.cloud.mutations()[before:] == []
    assert "nothing to create, resize, replace or delete" in capsys.readouterr().out


def test_a_tpu_count_edit_adds_then_removes_queued_resources(world, capsys):
    run_file = world.run_file("tpu")
    assert up(run_file) == 0
    world.run_file("tpu", fleet={"count": 4})
    assert up(run_file) == 0
    out = capsys.readouterr().out
    assert "  create  1 queued resource: v5litepod-8 in us-west4-a, us-east5-b; count 3 -> 4" in out
    assert queued("us-west4-a", "r1-0003") in world.cloud.ours()

    world.run_file("tpu", fleet={"count": 2})
    assert up(run_file) == 0
    out = capsys.readouterr().out
    assert "  delete  queued_resource r1-0002 (us-west4-a): count 4 -> 2" in out
    assert "  delete  queued_resource r1-0003 (us-west4-a): count 4 -> 2" in out
    left = [k for k in world.cloud.ours() if "/queuedResources/" in k]
    assert left == [queued("us-west4-a", "r1-0000"), queued("us-west4-a", "r1-0001")]
    states = {r.resource.name: r.state for r in RunRecord(world.store()).resources()}
    assert states == {"r1-0000": "created", "r1-0001": "created", "r1-0002": "deleted", "r1-0003": "deleted"}
    assert recorded_fleet(world)["count"] == 2


def test_a_machine_type_edit_replaces_the_template_and_the_group(world, capsys, tmp_path):
    run_file = world.run_file("vm")
    assert up(run_file) == 0
    spec = yaml.safe_load((REPO / "templates" / "vm.yaml").read_text())
    spec.update(machine_type="n1-standard-8", gpu_type="nvidia-tesla-t4", gpu_count=1)
    (tmp_path / "t4.yaml").write_text(yaml.safe_dump(spec))
    world.run_file("vm", fleet={"spec": str(tmp_path / "t4.yaml")}, plan={"model_config": None})
    capsys.readouterr()
    assert main(["up", str(run_file), "--dry-run", "--prices", str(_prices_with(tmp_path, "n1-standard-8"))]) == 0
    dry = capsys.readouterr().out
    assert "  replace 2 resources (instance_template r1 (global), instance_group r1 (us-central1-a)): the machines " \
           "change (g2-standard-8 -> n1-standard-8)" in dry
    assert world.cloud.resources[TEMPLATE]["properties"]["machineType"] == "g2-standard-8"

    assert up(run_file, "--prices", str(_prices_with(tmp_path, "n1-standard-8"))) == 0
    assert world.cloud.resources[TEMPLATE]["properties"]["machineType"] == "n1-standard-8"
    assert world.cloud.created["instance_template/r1"] == 2 and world.cloud.created["instance_group/r1"] == 2
    assert world.cloud.ours() == [TEMPLATE, GROUP]
    assert main(["down", str(run_file), "--yes"]) == 0
    assert world.cloud.ours() == []


def _prices_with(tmp_path, machine_type: str):
    """The price table with `machine_type` priced like g2-standard-8 (pricing unpriced types is another issue's)."""
    table = json.loads((REPO / "reporting" / "prices.json").read_text())
    for section in table.values():
        if isinstance(section, dict) and "g2-standard-8" in section and machine_type not in section:
            section[machine_type] = section["g2-standard-8"]
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(table))
    return path


def test_a_changed_queue_is_refused_with_the_reason_and_nothing_is_made(world, capsys):
    run_file = world.run_file("tpu")
    assert up(run_file) == 0
    old_queue = f"gs://{world.bucket}/jobs/r1"
    capsys.readouterr()
    before = len(world.cloud.mutations())
    world.run_file("tpu", queue=f"gs://{world.bucket}/jobs/r1-moved")
    assert up(run_file) == 65
    err = capsys.readouterr().err
    assert f"{run_file}: queue: run 'r1' already has machines working on the queue {old_queue}" in err
    assert f"gcs-spawner down {old_queue} --yes" in err
    assert world.names("jobs/r1-moved") == []
    assert world.cloud.mutations()[before:] == []


def test_a_renamed_run_is_refused_naming_the_field(world, capsys):
    run_file = world.run_file("tpu")
    assert up(run_file) == 0
    capsys.readouterr()
    before = len(world.cloud.mutations())
    run_file.write_text(json.dumps(world.run("tpu", name="r2")))  # run_file's own `name` is the file's
    assert up(run_file) == 65
    err = capsys.readouterr().err
    assert f"{run_file}: name: the queue gs://{world.bucket}/jobs/r1 holds the record of run 'r1', not 'r2'" in err
    assert world.cloud.mutations()[before:] == []


def test_down_after_the_queue_was_edited_finds_every_resource_by_its_label(world, capsys):
    run_file = world.run_file("tpu")
    assert up(run_file) == 0
    assert len(world.cloud.ours()) == 6
    world.run_file("tpu", queue=f"gs://{world.bucket}/jobs/elsewhere")
    capsys.readouterr()
    assert main(["down", str(run_file), "--yes"]) == 0
    out = capsys.readouterr().out
    assert ("down: found 3 resources of run 'r1' beyond the record of gs://" in out
            and "(by the label spawn-run=r1): queued_resource r1-0000 (us-west4-a)" in out)
    assert world.cloud.ours() == []
    # Each is marked deleted in the record of the queue its machines were told: a down there sends nothing.
    assert {r.state for r in RunRecord(world.store()).resources()} == {"deleted"}


def test_down_of_a_queue_whose_run_file_is_lost_deletes_what_its_label_finds_beyond_the_record(world, capsys):
    """An up interrupted between its create and its record's `created` leaves the record right (write-ahead);
    here a resource of the run made outside the record (a TPU VM made by hand with the run's label) is found too."""
    run_file = world.run_file("vm")
    assert up(run_file) == 0
    node = f"projects/{PROJECT}/locations/us-central1-a/nodes/r1-extra"
    world.cloud.add(node, {"name": node, "state": "READY", "acceleratorType": "v5litepod-8",
                           "labels": {"spawn-run": "r1"}})
    run_file.unlink()
    assert main(["down", f"gs://{world.bucket}/jobs/r1", "--yes"]) == 0
    assert "beyond the record" in capsys.readouterr().out
    assert world.cloud.ours() == []


def _machine_record(world, name: str, state: str, age_s: float, **fields) -> None:
    from fleet.machines import make_record, write_record

    at = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=age_s)
    write_record(world.store(), make_record(name, state, at=at, since=at.isoformat(timespec="seconds"), **fields))


def test_machines_down_deleted_show_as_deleted_not_up(world, capsys):
    run_file = world.run_file("vm")
    assert up(run_file) == 0
    for name in ("r1-aaaa", "r1-bbbb"):
        _machine_record(world, name, "installing", 60, machine_type="g2-standard-8")
    capsys.readouterr()
    assert main(["status", str(run_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fleet"]["workers_up"] == 2
    assert main(["down", str(run_file), "--yes"]) == 0
    capsys.readouterr()
    assert main(["status", str(run_file), "--json"]) == 0
    fleet = json.loads(capsys.readouterr().out)["fleet"]
    assert fleet["workers_up"] == 0 and fleet["by_state"] == {"exited": 2}
    assert [m["condition"] for m in fleet["roster"]] == ["exited", "exited"]


class _Members:
    """Group members of the fake that only exist (tests/cloud/fakecloud.py's Machines)."""

    def created(self, instance: str, resource: dict) -> None:
        pass

    def deleted(self, instance: str) -> None:
        pass


def test_keep_deletes_a_lost_vm_the_cloud_still_has_and_notes_why(world, capsys):
    world.cloud.machines = _Members()
    run_file = world.run_file("vm")
    assert up(run_file) == 0
    members = world.cloud.members(GROUP)
    lost, alive = (m.rsplit("/", 1)[-1] for m in members)
    _machine_record(world, lost, "working", 3600, machine_type="g2-standard-8", beat_s=60)
    _machine_record(world, alive, "working", 10, machine_type="g2-standard-8", beat_s=60)
    capsys.readouterr()
    assert main(["status", str(run_file)]) == 0
    status = capsys.readouterr().out
    assert f"gcs-spawner keep {run_file} --once" in status  # status names the command that deletes it
    assert main(["keep", str(run_file), "--once"]) == 0
    assert "lost_deleted=1" in capsys.readouterr().out
    assert world.cloud.members(GROUP) == [m for m in members if m.endswith(alive)]
    assert world.cloud.resources[GROUP]["targetSize"] == 1  # deleteInstances: the group does not make it again
    note = json.loads(world.store().read(f"run/deleted/{lost}.json").data)
    assert note["by"] == "gcs-spawner keep" and note["reason"].startswith("lost: its last record was 36")
    assert main(["status", str(run_file), "--json"]) == 0
    fleet = json.loads(capsys.readouterr().out)["fleet"]
    assert fleet["lost"] == [] and fleet["by_state"] == {"exited": 1, "working": 1}
    assert main(["keep", str(run_file), "--once"]) == 0  # the second step finds nothing to delete
    assert "lost_deleted=0" in capsys.readouterr().out


def test_keep_deletes_a_lost_tpu_vm_the_cloud_still_has(world, capsys):
    run_file = world.run_file("tpu")
    assert up(run_file) == 0
    capsys.readouterr()
    assert main(["status", str(run_file)]) == 0  # right after up, status shows the queued resources up made
    assert f"run resources (recorded in gs://{world.bucket}/jobs/r1/run/resources/): 3 queued resources created" in \
        capsys.readouterr().out
    _machine_record(world, "r1-0001", "working", 3600, machine_type="v5litepod-8", beat_s=60)
    assert main(["keep", str(run_file), "--once"]) == 0
    out = capsys.readouterr().out
    assert "lost_deleted=1" in out
    assert queued("us-west4-a", "r1-0001") not in world.cloud.ours()
    assert json.loads(world.store().read("run/deleted/r1-0001.json").data)["by"] == "gcs-spawner keep"


def test_a_zone_that_does_not_exist_or_lacks_the_type_is_refused_before_anything_is_made(world, capsys):
    run_file = world.run_file("tpu", fleet={"zones": ["us-west9-z"]})
    assert up(run_file) == 65
    err = capsys.readouterr().err
    assert f"{run_file}: fleet.zones: zone 'us-west9-z' does not exist in project {PROJECT}" in err

    world.cloud.offer(PROJECT, "europe-west4-b", machine_types=("n2-standard-8",), tpu_types=("v6e-8",))
    run_file = world.run_file("tpu", fleet={"zones": ["europe-west4-b"]})
    assert up(run_file) == 65
    err = capsys.readouterr().err
    assert (f"{run_file}: fleet.spec.accelerator_type: zone europe-west4-b does not offer 'v5litepod-8' (it offers "
            "e.g. v6e-8)") in err

    run_file = world.run_file("vm", fleet={"zones": ["europe-west4-b"]})
    assert up(run_file) == 65
    assert "fleet.spec.machine_type: zone europe-west4-b does not offer 'g2-standard-8'" in capsys.readouterr().err
    assert world.cloud.mutations() == [] and world.names() == []


def test_a_bucket_typo_in_the_jobs_data_files_exits_65_naming_the_field(world, capsys):
    run_file = world.run_file("tpu", job={"data_files": f"gs://{world.bucket}-typo/data/*.parquet"})
    assert up(run_file) == 65
    err = capsys.readouterr().err
    assert f"{run_file}: job: data_files[0]: bucket {world.bucket}-typo of gs://{world.bucket}-typo/data/*.parquet " \
           "does not exist" in err
    assert world.cloud.mutations() == [] and world.names() == []
