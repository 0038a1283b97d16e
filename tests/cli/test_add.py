"""`gcs-spawner add` (issue 47, item 6: one interface): more machines of another spec on a run's queue, against the
fake GCS server and the fake Compute and TPU APIs through the real clients. Named after the run, recorded
write-ahead, shown by status, deleted by down (also when found by label alone), left alone by a second up and by
keep; refused like up (the zone, the type, the record, the count), creating nothing."""

from __future__ import annotations

import json

import pytest
import yaml

from gcs_spawner.cli import main
from gcs_spawner.record import RunRecord
from tests.cli.conftest import PROJECT, REPO

ADDED_GROUP = f"projects/{PROJECT}/zones/us-central1-a/instanceGroupManagers/r1-gpu"
ADDED_TEMPLATE = f"projects/{PROJECT}/global/instanceTemplates/r1-gpu"


def queued(zone: str, rid: str) -> str:
    return f"projects/{PROJECT}/locations/{zone}/queuedResources/{rid}"


def spec_file(world, kind: str, name: str, **changes) -> str:
    spec = yaml.safe_load((REPO / "templates" / f"{kind}.yaml").read_text())
    spec.update(name=name, **changes)
    path = world.dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_add_makes_tpus_beside_the_run_that_status_shows_up_and_keep_leave_alone_and_down_deletes(world, capsys):
    run_file = world.run_file("tpu")
    assert main(["up", str(run_file), "--yes"]) == 0
    single = spec_file(world, "tpu", "single8", accelerator_type="v5litepod-8")
    capsys.readouterr()
    before = len(world.cloud.mutations())
    assert main(["add", str(run_file), "--spec", single, "--count", "1", "--zone", "us-east5-b", "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "  create  1 queued resource (r1-single8-0000): v5litepod-8 in us-east5-b" in dry
    assert "would send CreateQueuedResourceRequest parent=projects/proj-run/locations/us-east5-b " \
           "queued_resource_id=r1-single8-0000" in dry
    assert world.cloud.mutations()[before:] == []

    assert main(["add", str(run_file), "--spec", single, "--count", "1", "--zone", "us-east5-b", "--yes"]) == 0
    node = world.cloud.resources[queued("us-east5-b", "r1-single8-0000")]["tpu"]["nodeSpec"][0]["node"]
    assert node["labels"]["spawn-run"] == "r1" and node["labels"]["spawn-add"] == "single8"
    assert node["metadata"]["spawn-queue"] == f"gs://{world.bucket}/jobs/r1"
    states = {r.resource.name: r.state for r in RunRecord(world.store()).resources()}
    assert states["r1-single8-0000"] == "created"
    added = json.loads(world.store().read("run/run.json").data)["added"]["single8"]
    assert (added["name"], added["machines"], added["zone"]) == ("r1-single8", 1, "us-east5-b")

    capsys.readouterr()
    assert main(["status", str(run_file), "--cloud"]) == 0
    status = capsys.readouterr().out
    assert "added beside the fleet (gcs-spawner add): r1-single8: 1 x v5litepod-8 in us-east5-b" in status
    assert "queued_resource r1-single8-0000 (us-east5-b): ACTIVE (v5litepod-8) [added: single8]" in status

    before = len(world.cloud.mutations())
    assert main(["up", str(run_file), "--yes"]) == 0  # not a drift for up to undo
    assert "nothing to create, resize, replace or delete" in capsys.readouterr().out
    assert main(["keep", str(run_file), "--once"]) == 0  # nor a queued resource of the run's keeper
    assert world.cloud.mutations()[before:] == []

    assert main(["add", str(run_file), "--spec", single, "--count", "2", "--zone", "us-east5-b", "--yes"]) == 0
    assert [k for k in world.cloud.ours() if "queuedResources/r1-single8" in k] == [
        queued("us-east5-b", f"r1-single8-{i:04d}") for i in range(3)]  # numbered on
    assert world.cloud.created["queued_resource/r1-single8-0000"] == 1

    assert main(["down", str(run_file), "--yes"]) == 0
    assert world.cloud.ours() == []


def test_a_gpu_group_added_to_a_tpu_run_is_resized_by_a_second_add_and_down_finds_it_by_label_alone(world, capsys):
    run_file = world.run_file("tpu")
    assert main(["up", str(run_file), "--yes"]) == 0
    gpu = spec_file(world, "vm", "gpu")
    assert main(["add", str(run_file), "--spec", gpu, "--count", "2", "--zone", "us-central1-a", "--yes"]) == 0
    template = world.cloud.resources[ADDED_TEMPLATE]["properties"]
    assert template["labels"]["spawn-run"] == "r1" and template["labels"]["spawn-add"] == "gpu"
    assert world.cloud.resources[ADDED_GROUP]["targetSize"] == 2
    capsys.readouterr()
    assert main(["add", str(run_file), "--spec", gpu, "--count", "1", "--zone", "us-central1-a", "--yes"]) == 0
    assert "  resize  instance_group r1-gpu (us-central1-a): 2 -> 3 (adds 1)" in capsys.readouterr().out
    assert world.cloud.resources[ADDED_GROUP]["targetSize"] == 3
    assert world.cloud.created["instance_template/r1-gpu"] == 1 and world.cloud.created["instance_group/r1-gpu"] == 1

    before = len(world.cloud.mutations())
    assert main(["up", str(run_file), "--yes"]) == 0  # a TPU run's up replaces no VM group that add made
    assert world.cloud.mutations()[before:] == []

    store = world.store()  # the added resources' record objects lost: down finds them by the run's label
    for name in [n for n in world.names(under="run/resources/") if "r1-gpu" in n]:
        store.delete(name)
    capsys.readouterr()
    assert main(["down", str(run_file), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "beyond the record" in out and "instance_group r1-gpu (us-central1-a)" in out
    assert world.cloud.ours() == []


def test_keep_deletes_a_lost_added_tpu_the_cloud_still_has(world, capsys):
    from tests.cli.test_converge import _machine_record

    run_file = world.run_file("tpu")
    assert main(["up", str(run_file), "--yes"]) == 0
    single = spec_file(world, "tpu", "single8")
    assert main(["add", str(run_file), "--spec", single, "--count", "1", "--zone", "us-east5-b", "--yes"]) == 0
    _machine_record(world, "r1-single8-0000", "working", 3600, machine_type="v5litepod-8", beat_s=60)
    capsys.readouterr()
    assert main(["keep", str(run_file), "--once"]) == 0
    assert "lost_deleted=1" in capsys.readouterr().out
    assert queued("us-east5-b", "r1-single8-0000") not in world.cloud.ours()


@pytest.mark.parametrize("case", ["not up", "zone typo", "no such zone", "zone lacks type", "spec missing",
                                  "unknown tpu", "count 0"])
def test_add_refuses_what_cannot_work_naming_it_and_makes_nothing(world, capsys, case):
    run_file = world.run_file("tpu")
    if case != "not up":
        assert main(["up", str(run_file), "--yes"]) == 0
    single = spec_file(world, "tpu", "single8")
    argv = ["add", str(run_file), "--spec", single, "--count", "1", "--zone", "us-east5-b", "--yes"]
    code, said = {
        "not up": (65, f"run 'r1' has no record at gs://{world.bucket}/jobs/r1/run/run.json: bring it up first"),
        "zone typo": (65, "--zone: 'us-east5b' is not a zone"),
        "no such zone": (65, f"--zone: zone 'us-east9-b' does not exist in project {PROJECT}"),
        "zone lacks type": (65, f"{single}: accelerator_type: zone us-east5-b does not offer 'v5litepod-32'"),
        "spec missing": (65, "nope.yaml: cannot read the spec file: No such file or directory"),
        "unknown tpu": (65, f"{single}: accelerator_type: "),
        "count 0": (2, "--count: 0; add makes 1 or more machines"),
    }[case]
    if case == "zone typo":
        argv[argv.index("us-east5-b")] = "us-east5b"
    elif case == "no such zone":
        argv[argv.index("us-east5-b")] = "us-east9-b"
    elif case == "zone lacks type":
        argv[argv.index(single)] = spec_file(world, "tpu", "single8", accelerator_type="v5litepod-32")
    elif case == "spec missing":
        argv[argv.index(single)] = str(world.dir / "nope.yaml")
    elif case == "unknown tpu":
        argv[argv.index(single)] = spec_file(world, "tpu", "single8", accelerator_type="v6f-8")
    elif case == "count 0":
        argv[argv.index("--count") + 1] = "0"
    before = len(world.cloud.mutations())
    capsys.readouterr()
    assert main(argv) == code
    assert said in capsys.readouterr().err
    assert world.cloud.mutations()[before:] == []
    assert not [n for n in world.names(under="run/resources/") if "single8" in n]
