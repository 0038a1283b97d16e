"""`gcs-spawner up` and `down` against the fake GCS server and the fake Compute and TPU APIs (real clients over HTTP):
up creates the run's resources, a second up creates nothing, down deletes exactly what up made and leaves the data;
an up interrupted at every event of its run (a real SIGINT to this process), then run again, creates nothing twice;
an interrupted up followed by down leaves nothing behind."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gcs_spawner.cli import main
from gcs_spawner.record import RunRecord
from tests.cli.conftest import PROJECT, REPO

TPU_RESOURCES = [f"projects/{PROJECT}/locations/us-west4-a/{kind}/r1-000{i}" for kind in ("nodes", "queuedResources")
                 for i in range(3)]
VM_RESOURCES = [f"projects/{PROJECT}/global/instanceTemplates/r1", f"projects/{PROJECT}/zones/us-central1-a/instanceGroupManagers/r1"]
EXPECTED = {"tpu": TPU_RESOURCES, "vm": VM_RESOURCES}
CREATED = {"tpu": [f"queued_resource/r1-000{i}" for i in range(3)], "vm": ["instance_group/r1", "instance_template/r1"]}
TASKS = [f"tasks/t{i:06d}.json" for i in range(5)]  # 50 rows, rows_per_task 10


def up(run_file, *flags: str) -> int:
    return main(["up", str(run_file), "--yes", *flags])


def data_objects(world) -> list[str]:
    """The queue's data (what down must leave): job.json and the task manifests."""
    return [n for n in world.names() if n == "job.json" or n.startswith("tasks/")]


@pytest.mark.parametrize("kind", ["tpu", "vm"])
def test_up_creates_the_run_and_down_deletes_exactly_that_leaving_the_data(world, kind: str, capsys):
    run_file = world.run_file(kind)
    assert up(run_file) == 0
    assert world.cloud.ours() == EXPECTED[kind]
    assert sorted(world.cloud.created) == CREATED[kind]
    if kind == "vm":
        group = world.cloud.resources[VM_RESOURCES[1]]
        assert group["targetSize"] == 2 and group["instanceTemplate"].endswith("/instanceTemplates/r1")
        template = world.cloud.resources[VM_RESOURCES[0]]["properties"]
        assert template["labels"]["spawn-run"] == "r1"
        items = {i["key"]: i["value"] for i in template["metadata"]["items"]}
        assert (items["spawn-queue"], items["spawn-code"]) == (f"gs://{world.bucket}/jobs/r1", f"gs://{world.bucket}/code/r1")
    else:
        node = world.cloud.resources[TPU_RESOURCES[3]]["tpu"]["nodeSpec"][0]["node"]
        assert node["labels"]["spawn-run"] == "r1" and node["metadata"]["spawn-queue"] == f"gs://{world.bucket}/jobs/r1"
    assert data_objects(world) == ["job.json", *TASKS]
    assert json.loads(world.store().read("job.json").data) == world.run(kind)["job"]
    assert "config.json" in world.names("models/tiny")  # the checkpoint was mirrored
    out = capsys.readouterr().out
    assert "considered resources" in out and f"gcs-spawner down {run_file}" in out
    recorded = RunRecord(world.store()).resources()
    assert sorted(f"{r.resource.kind}/{r.resource.name}" for r in recorded) == CREATED[kind]
    assert {r.state for r in recorded} == {"created"}

    # A second up finds everything made and makes nothing.
    before = len(world.cloud.mutations())
    assert up(run_file) == 0
    assert world.cloud.mutations()[before:] == []
    assert all(n == 1 for n in world.cloud.created.values())

    assert main(["down", str(run_file), "--yes"]) == 0
    assert world.cloud.ours() == []
    assert data_objects(world) == ["job.json", *TASKS]  # the data stays
    assert {r.state for r in RunRecord(world.store()).resources()} == {"deleted"}
    before = len(world.cloud.mutations())
    assert main(["down", str(run_file), "--yes"]) == 0  # idempotent: nothing left to send
    assert world.cloud.mutations()[before:] == []


class InterruptAt(logging.Handler):
    """Sends this process a real SIGINT at the `at`-th event (a `key=value` log line of the main thread), which
    Python raises as KeyboardInterrupt right there, as Ctrl-C would. `at=None` only counts."""

    def __init__(self, at: int | None = None):
        super().__init__(logging.INFO)
        self.at, self.events = at, []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith("event=") or threading.current_thread() is not threading.main_thread():
            return
        self.events.append(f"{record.name}:{message.split()[0]}")
        if len(self.events) == self.at:
            os.kill(os.getpid(), signal.SIGINT)


def _up_with(handler: InterruptAt, run_file) -> bool:
    """Up with `handler` on the root logger; whether it was interrupted."""
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)  # setLevel, not `.level =`: loggers cache whether a level is enabled
    try:
        from gcs_spawner import up as up_module
        from gcs_spawner.runfile import load_run

        up_module.up(load_run(run_file), yes=True, out=open(os.devnull, "w"))
        return False
    except KeyboardInterrupt:
        return True
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.mark.parametrize("kind", ["tpu", "vm"])
def test_up_interrupted_at_every_event_then_run_again_creates_nothing_twice_and_down_leaves_nothing(
        world, kind: str, monkeypatch):
    """Exhaustive over the events of one up (each step's end, each resource created, each file mirrored; for the VM
    run, those of its machines step, the others being the TPU run's): interrupt there; then (a) up again finishes the run with every resource created exactly once, and down deletes it all;
    and, at each step's end, (b) down right after the interruption deletes whatever the interrupted up had made.

    A submit waits out GCS's one write a second to its batch marker; the fake server has no such limit, and the
    wait has nothing to do with what is checked here, so it is set to nothing (66 ups would wait a minute)."""
    from objectstore.gcs import GCSStore

    monkeypatch.setattr(GCSStore, "same_object_write_gap_s", 0.0)
    counting = InterruptAt()
    assert not _up_with(counting, world.run_file(kind))
    reference = counting.events
    reference_data = data_objects(world)
    assert len(reference) >= 8, reference
    # The steps before the machines are the same for both kinds: the VM run is interrupted only in its own.
    first = 1 if kind == "tpu" else reference.index("gcs_spawner:event=submitted") + 2
    for k in range(first, len(reference) + 1):
        for then_down_at_once in (False, True) if "step_done" in reference[k - 1] else (False,):
            world.cloud.reset()
            world.new_bucket()
            run_file = world.run_file(kind)
            assert _up_with(InterruptAt(k), run_file), f"not interrupted at event {k}: {reference[k - 1]}"
            where = f"interrupted at event {k} ({reference[k - 1]})"
            if then_down_at_once:
                assert main(["down", str(run_file), "--yes"]) == 0, where
                assert world.cloud.ours() == [], where
                continue
            assert not _up_with(InterruptAt(), run_file), where
            assert world.cloud.ours() == EXPECTED[kind], where
            assert sorted(world.cloud.created) == CREATED[kind], where
            assert set(world.cloud.created.values()) == {1}, f"{where}: {world.cloud.created}"
            assert data_objects(world) == reference_data, where
            running = [e.name for e in world.store().list("batches/") if e.metadata.get("state") != "done"]
            assert running == [], where
            assert main(["down", str(run_file), "--yes"]) == 0, where
            assert world.cloud.ours() == [], where


def test_dry_runs_print_one_line_per_call_and_change_nothing(world, capsys):
    run_file = world.run_file("vm")
    assert main(["up", str(run_file), "--dry-run"]) == 0
    would = [line for line in capsys.readouterr().out.splitlines() if line.startswith("would ")]
    assert world.cloud.mutations() == [] and world.names() == [] and world.names("models/tiny") == []
    assert [w.split()[1:3] for w in would] == [
        ["write", f"gs://{world.bucket}/jobs/r1/run/run.json"], ["mirror", "the"], ["submit", f"gs://{world.bucket}/jobs/r1/job.json"],
        ["send", "InsertInstanceTemplateRequest"], ["send", "InsertInstanceGroupManagerRequest"]]
    assert max(len(w) for w in would) < 300

    assert up(run_file) == 0
    capsys.readouterr()
    assert main(["down", str(run_file), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        f"would send DeleteInstanceGroupManagerRequest zone=us-central1-a project={PROJECT} instance_group_manager=r1",
        f"would send DeleteInstanceTemplateRequest project={PROJECT} instance_template=r1"]
    assert world.cloud.ours() == VM_RESOURCES


def test_tpu_dry_run_lists_the_queued_resources_it_would_create(world, capsys):
    assert main(["up", str(world.run_file("tpu")), "--dry-run"]) == 0
    creates = [line for line in capsys.readouterr().out.splitlines() if "CreateQueuedResourceRequest" in line]
    assert creates == [f"would send CreateQueuedResourceRequest parent=projects/{PROJECT}/locations/us-west4-a "
                       f"queued_resource_id=r1-000{i}" for i in range(3)]
    assert world.cloud.mutations() == []


def test_up_without_a_terminal_or_yes_asks_for_yes_and_creates_nothing(world, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    assert main(["up", str(world.run_file("tpu"))]) == 2
    assert "pass --yes" in capsys.readouterr().err
    assert world.cloud.mutations() == [] and world.names() == []


def test_down_of_an_unfinished_job_asks_first(world, capsys, monkeypatch):
    run_file = world.run_file("vm")
    assert up(run_file) == 0
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    assert main(["down", str(run_file)]) == 2
    assert "not complete (0 of 5 tasks done" in capsys.readouterr().err
    assert world.cloud.ours() == VM_RESOURCES


def _cli(*argv: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gcs_spawner", "-v", *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.parametrize("step", ["submit"])
def test_a_real_ctrl_c_after_a_step_then_up_again_creates_nothing_twice(world, step: str):
    """The command in its own process, SIGINT sent when it logs the end of `step`: it exits 1 saying it was
    interrupted, and the same command again finishes the run, creating each resource once. The next step's first
    create is held by the fake cloud until the signal is sent: otherwise, on a loaded machine, the command could
    finish before this test has read its line (it did once, the signal landing in the interpreter's exit)."""
    run_file = world.run_file("tpu")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    held, signalled, handle = threading.Event(), threading.Event(), world.cloud.handle

    def hold_the_first_fleet_create(request):
        if request.method == "POST" and request.path.endswith(("/queuedResources", "/nodes")) and not held.is_set():
            held.set()
            signalled.wait(60)
        return handle(request)

    world.cloud.handle = hold_the_first_fleet_create
    first = _cli("up", str(run_file), "--yes", env=env)
    seen = []
    for line in first.stderr:
        seen.append(line)
        if f"event=step_done step={step} " in line:
            first.send_signal(signal.SIGINT)
            signalled.set()
            break
    first.stderr.read()
    assert first.wait(timeout=120) == 1, "".join(seen)
    again = subprocess.run([sys.executable, "-m", "gcs_spawner", "up", str(run_file), "--yes"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert world.cloud.ours() == TPU_RESOURCES
    assert set(world.cloud.created.values()) == {1} and sorted(world.cloud.created) == CREATED["tpu"]


def test_plain_tpu_nodes_are_created_once_and_deleted(world):
    """`queued: false`: up makes nodes NAME-NNNN in the first zone (no keeper), once; down deletes them."""
    import yaml

    spec = {**yaml.safe_load((REPO / "templates" / "tpu.yaml").read_text()), "queued": False}
    run_file = world.run_file("tpu", fleet={"spec": spec, "keeper": False})
    assert up(run_file) == 0 and up(run_file) == 0
    nodes = [f"projects/{PROJECT}/locations/us-west4-a/nodes/r1-000{i}" for i in range(3)]
    assert world.cloud.ours() == nodes
    assert world.cloud.created == {f"tpu_node/r1-000{i}": 1 for i in range(3)}
    assert world.cloud.resources[nodes[0]]["schedulingConfig"] == {"spot": True}
    assert main(["down", str(run_file), "--yes"]) == 0
    assert world.cloud.ours() == []


def _preempt(world, rid: str) -> None:
    world.cloud.set_queued_resource_state(f"projects/{PROJECT}/locations/us-west4-a/queuedResources/{rid}", "SUSPENDED")


def test_keep_replaces_a_preempted_tpu_and_down_deletes_the_replacement_too(world, capsys):
    run_file = world.run_file("tpu")
    assert up(run_file) == 0
    _preempt(world, "r1-0001")
    assert main(["keep", str(run_file), "--once"]) == 0
    assert "alive=2 deleted=1 created=1" in capsys.readouterr().out
    assert f"projects/{PROJECT}/locations/us-west4-a/queuedResources/r1-0003" in world.cloud.ours()
    recorded = sorted(r.resource.name for r in RunRecord(world.store()).resources())
    assert recorded == ["r1-0000", "r1-0001", "r1-0002", "r1-0003"]
    assert main(["down", str(run_file), "--yes"]) == 0
    assert world.cloud.ours() == []


def test_keep_adds_no_machine_once_the_fleet_has_spent_the_limit(world, capsys):
    """The fleet's cost so far comes from its machine records (reporting/cost.py): one v5litepod-8 spot machine that
    worked 1,000 hours has spent far more than a 50 $ limit, so a preempted machine is not replaced."""
    from fleet.machines import make_record, write_record

    run_file = world.run_file("tpu", max_dollars=50.0, plan={"tokens_per_row": 40.0})
    assert up(run_file) == 0
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    write_record(world.store(), make_record("r1-0000", "working", machine_type="v5litepod-8", provisioning="spot",
                                            since=now, spent={"working": 3600 * 1000}))
    _preempt(world, "r1-0001")
    assert main(["keep", str(run_file), "--once"]) == 0
    assert "created=0" in capsys.readouterr().out
    assert f"projects/{PROJECT}/locations/us-west4-a/queuedResources/r1-0003" not in world.cloud.ours()


def test_up_uploads_the_code_once_through_the_client_and_reports_progress_in_a_log(world, tmp_path, monkeypatch,
                                                                                    capsys):
    """code.upload with a checkout of its own, no gcloud on PATH (so google-cloud-storage syncs it) and no locks
    (environment: false: compiling them needs the package index): the files land under code.url, a second up
    uploads nothing, and the log has the step's progress line."""
    source = tmp_path / "checkout"
    (source / "fleet").mkdir(parents=True)
    (source / "spawn.py").write_text("print('spawn')\n")
    (source / "fleet" / "__init__.py").write_text("")
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and not os.path.exists(os.path.join(p, "gcloud"))]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    run_file = world.run_file("tpu", code={"url": f"gs://{world.bucket}/code/fresh", "upload": True,
                                           "source": str(source), "environment": False})
    assert up(run_file) == 0
    assert world.names("code/fresh") == ["fleet/__init__.py", "spawn.py"]
    assert "event=progress_done step=code done=" in capsys.readouterr().err
    generations = {e.name: e.generation for e in world.store("code/fresh").list("")}
    assert up(run_file) == 0
    assert {e.name: e.generation for e in world.store("code/fresh").list("")} == generations


def test_a_second_up_through_gcloud_rewrites_no_code_object_whose_content_is_unchanged(world, tmp_path, monkeypatch):
    """code.upload through the real gcloud (pointed at the fake GCS): files with the same content and new mtimes (a
    fresh clone; the environment up builds in a new scratch directory each time) are not uploaded again, so a second
    up mid-run rewrites nothing that booting machines are syncing."""
    from tests.gcloudcli import require_gcloud, write_config

    require_gcloud()
    source = tmp_path / "checkout"
    (source / "fleet").mkdir(parents=True)
    (source / "spawn.py").write_text("print('spawn')\n")
    (source / "fleet" / "__init__.py").write_text("")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(write_config(tmp_path / "gcloud", storage=world.gcs.url)))
    run_file = world.run_file("tpu", code={"url": f"gs://{world.bucket}/code/fresh", "upload": True,
                                           "source": str(source), "environment": False})
    assert up(run_file) == 0
    generations = {e.name: e.generation for e in world.store("code/fresh").list("")}
    assert sorted(generations) == ["fleet/__init__.py", "spawn.py"]
    later = time.time() + 3600
    for path in source.rglob("*"):
        os.utime(path, (later, later))
    assert up(run_file) == 0
    assert {e.name: e.generation for e in world.store("code/fresh").list("")} == generations


def test_the_lock_up_uploads_is_the_same_bytes_from_any_scratch_directory(tmp_path):
    """`up` compiles the run's lock in a new scratch directory every time (fleet.environment.upload_code): the lock must
    not name it, or each up uploads a different lock and every machine that reboots installs again (startup.sh keys
    its install on the lock's hash). Offline: two tiny wheels built here, as tests/cloud/test_codesync.py does."""
    from fleet import environment
    from tests.cloud.test_codesync import _tiny_package

    index = tmp_path / "index"
    for name, version, deps in (("tinydep", "0.2.0", []), ("tinyapp", "0.1.0", ["tinydep>=0.2"])):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "--wheel-dir", str(index), str(_tiny_package(tmp_path / "src", name, version, deps))],
                       check=True, capture_output=True)
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    locks = [environment.compile_lock(["tinyapp"], tmp_path / scratch / "locks" / "cpu.txt", python_version, platform=None,
                                   index_args=["--no-index", "--find-links", str(index)]).read_text()
             for scratch in ("upload-code-1", "upload-code-2")]
    assert "tinydep==0.2.0" in locks[0] and "upload-code-1" not in locks[0]
    assert locks[0] == locks[1]


def test_up_on_a_terminal_asks_and_a_no_creates_nothing(world):
    """stdin a terminal (a pseudo-terminal here): up prints the plan, asks `Proceed? [y/N]` and, answered n, exits
    1 having made nothing."""
    import pty

    controller, terminal = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "gcs_spawner", "up", str(world.run_file("tpu"))], cwd=REPO,
                               env=env, stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(terminal)
    os.write(controller, b"n\n")
    out, err = process.communicate(timeout=120)
    os.close(controller)
    assert process.returncode == 1, err
    assert "considered resources" in out and "Proceed? [y/N]" in err and "not confirmed; nothing was created" in err
    assert world.cloud.mutations() == [] and world.names() == []


def test_a_cpu_vm_run_goes_up_priced_per_machine_hour_and_a_limit_it_cannot_check_stops_it(world, capsys):
    """A CPU fleet (a VM spec with accelerator: cpu on n2-standard-8, which reporting/prices.json prices under
    cpu_machines) gives the planner no peak FLOPs: up and plan show the machine's hourly price and say there is no
    estimate, and up makes the template and the group; with a max_dollars that nothing could check, up stops first."""
    import yaml

    from reporting.pricing import load_prices

    spec = {**yaml.safe_load((REPO / "templates" / "vm.yaml").read_text()), "machine_type": "n2-standard-8",
            "accelerator": "cpu"}
    limited = world.run_file("vm", name="limited.yaml", fleet={"spec": spec}, max_dollars=100.0)
    assert up(limited) == 65
    assert "max_dollars" in capsys.readouterr().err
    assert world.cloud.ours() == []
    run_file = world.run_file("vm", fleet={"spec": spec})
    assert up(run_file) == 0
    assert world.cloud.ours() == VM_RESOURCES
    spot = load_prices().cpu_machines["n2-standard-8"]["spot_per_hour"]
    line = f"2 x n2-standard-8 (CPU) at {spot:g} $ per machine-hour spot"
    assert line in capsys.readouterr().out
    items = {i["key"]: i["value"] for i in world.cloud.resources[VM_RESOURCES[0]]["properties"]["metadata"]["items"]}
    assert items["spawn-accelerator"] == "cpu"
    # plan states the job's hours and $ on the CPU machine type as on an accelerator: from the table's CPU peak, which
    # it names as assumed.
    assert main(["plan", str(run_file)]) == 0
    out = capsys.readouterr().out
    assert "machine-hours" in out and "compute $" in out and f"{spot:g} $/machine-hour" in out.replace(" / ", " ")
    assert "n2-standard-8" in out and "assumed: 8 vCPUs" in out
    assert main(["plan", str(run_file), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["accelerator"]["platform"] == "cpu" and plan["time"]["machine_hours"] > 0
    assert plan["compute_dollars"]["spot"] > 0
