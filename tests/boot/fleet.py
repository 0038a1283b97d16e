"""The whole fleet, rehearsed: a managed instance group of rehearsal machines on the tiny model, from
`up` to `down`, with a preemption, a second `up`, a late submit, and every machine deleting itself.

    sudo .venv/bin/python -m tests.boot.fleet [--machines 3] [--tasks 6] [--late 2] [--failed 1] [--keep]
    make rehearsal                                    # the same, with its defaults

What is real and what stands in is the boot rehearsal's (tests/boot/rehearsal.py, docs/CLOUD.md "The
boot, rehearsed"), per machine: the cached Debian root filesystem in namespaces of its own (network:
loopback only; PID and mount), the real startup/startup.sh from its own metadata server at
169.254.169.254:80, the real gcloud and uv, the code, wheels and interpreter that `gcs-spawner up` put
in the bucket, spawn.py and consume.py extracting with the tiny model. What this adds is the fleet around them:

- the fake Compute API (tests/cloud/fakecloud.py) keeps a managed instance group's members, made from
  the instance template `gcs-spawner up` sent, and hands each member it creates
  to `Fleet`, which boots it as a rehearsal machine with that instance's metadata (its name, the
  template's attributes, `created-by` naming the group); a member deleted through the API
  (deleteInstances, the group's delete) is shut down 3 s later, as a guest's shutdown would be;
- each machine reaches the fakes through listeners of its own, opened inside its network namespace,
  on the same state as the operator's (the driver here): the bucket, the Compute API; their request
  counts are that machine's;
- a preemption is what Compute Engine does to a spot VM (https://cloud.google.com/compute/docs/instances/spot,
  "Preemption process"): `instance/preempted` turns TRUE, the machine runs up to 30 s more, then stops; its
  template's termination action (DELETE) removes it and the group, whose defaultActionOnFailure is
  REPAIR, makes it again under its name (https://cloud.google.com/compute/docs/instance-groups/about-repairing-vms-in-a-mig),
  on a new boot disk;
- a failed boot: the first member the group makes has a bucket listener that refuses it the code (403, as
  Cloud Storage answers an account without the role: tests/boot/machines.refuse_code). Its startup.sh must
  record `failed` with the refusal as its reason and leave the group through deleteInstances, as any
  failed boot does; the other members do the work.

The operator drives it as a user would, each command a process of its own (`python -m gcs_spawner`, the
console script's module) with no terminal: `write_run` writes the run file (its job and first tasks,
the model to mirror, the queue, the code with its wheelhouse and interpreter, the VM spec with the
rehearsal's spawn flags, the count and the zone), then `gcs-spawner up run.yaml --yes` (the pre-flight
against the fakes, the mirror, the code upload, the submit, the template and the group), the same `up`
again mid-run, `gcs-spawner submit run.yaml --tasks late.jsonl`, `gcs-spawner down run.yaml` (no --yes:
it goes on only when status's completion rule, taskqueue/completion.py, says the job is complete) and
`gcs-spawner merge run.yaml`. Its environment points the clients at the fakes as tests/cli's does
(FLEET_*_ENDPOINT, STORAGE_EMULATOR_HOST, gcloud's endpoint overrides, no credentials) and uv's
interpreter downloads at the stand-in release (UV_PYTHON_*).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import yaml

from tests.boot import records
from tests.boot.machines import Command, MachineBoot, Machines, drive, run_command, table, wait
from tests.boot.rehearsal import (
    BUCKET, PROJECT, REPO, ZONE, Disk, Namespaces, Rehearsal, RehearsalError, instance_metadata, release_host,
    remove_in_background, standin_release,
)  # fmt: skip
from tests.cloud.fakecloud import PROJECT_NUMBER, FakeCloud
from tests.fakegcs.server import FakeGCS

RUN_NAME = "fleet"  # the run's: its template and group are named so, the members RUN_NAME-xxxx (runfile.py)
CODE_PREFIX = "code/fleet/"
CODE = f"gs://{BUCKET}/{CODE_PREFIX.rstrip('/')}"
QUEUE = f"gs://{BUCKET}/jobs/fleet"
GROUP = f"projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/{RUN_NAME}"
TEMPLATE = f"projects/{PROJECT}/global/instanceTemplates/{RUN_NAME}"
MACHINE_TYPE = "n2-standard-8"
#: The project's default service account, as Compute Engine names it
#: (https://cloud.google.com/compute/docs/access/service-accounts#default_service_account).
SERVICE_ACCOUNT = f"{PROJECT_NUMBER}-compute@developer.gserviceaccount.com"
SHUTDOWN_S = 3.0  # from a delete request to the machine's end (a guest shutdown's stand-in)
PREEMPTION_NOTICE_S = 30.0  # Compute Engine's: at most this long from the notice to the stop


@dataclasses.dataclass
class Run(MachineBoot):
    """One boot of one instance (tests/boot/machines.MachineBoot): the instance, and which of its boots."""

    instance: str = ""
    boot: int = 1


class Fleet(Machines):
    """Boots what the fake Compute API creates (tests/cloud/fakecloud.Machines), each instance a
    rehearsal machine of its own, and shuts down what it deletes. The first boots of the first
    `failing` instances are refused the code (tests/boot/machines.refuse_code): failed boots."""

    def __init__(self, world: "FleetRehearsal", failing: int = 0):
        super().__init__(world)
        self.failing = failing

    @property
    def runs(self) -> list[Run]:
        return self.boots

    # -- what the fake Compute API calls (with its lock held: start work, never wait for it)

    def created(self, instance: str, resource: dict) -> None:
        with self.lock:
            boot = 1 + sum(r.instance == instance for r in self.runs)
            name = instance.rsplit("/", 1)[1]
            refused = boot == 1 and len({r.instance for r in self.runs}) < self.failing
            run = Run(name, Disk(self.world.workdir / f"{name}-boot{boot}"), refused=refused, instance=instance,
                      boot=boot)
            self.runs.append(run)
        run.thread = threading.Thread(target=self._boot, args=(run, resource), name=f"boot-{run.name}", daemon=True)
        run.thread.start()

    def deleted(self, instance: str) -> None:
        run = self.current(instance)
        if run is not None:
            threading.Timer(SHUTDOWN_S, self.halt, args=(run, "deleted")).start()

    # -- the machines

    def current(self, instance: str) -> Run | None:
        with self.lock:
            runs = [r for r in self.runs if r.instance == instance and r.ended is None]
        return runs[-1] if runs else None

    def _boot(self, run: Run, resource: dict) -> None:
        attributes = {item["key"]: item["value"] for item in resource["metadata"]["items"]}
        values = instance_metadata(run.name, attributes, resource["machineType"],
                                   spot=resource.get("scheduling", {}).get("provisioningModel") == "SPOT")
        self.boot(run, values, lambda: Namespaces(self.world.lower, [run.disk]))

    def preempt(self, run: Run) -> None:
        """A spot VM's preemption: the notice, up to PREEMPTION_NOTICE_S for the worker to hand its task
        back and leave its final record (it exits once it has), the stop, then the group's repair
        (FakeCloud.stopped). A worker that never writes that record is stopped at the notice's end."""
        run.metadata.set("instance/preempted", "TRUE")
        deadline = time.monotonic() + PREEMPTION_NOTICE_S
        while time.monotonic() < deadline and not self._left_final_record(run):
            time.sleep(0.5)
        self.halt(run, "preempted")
        self.world.cloud.stopped(run.instance)

    def _left_final_record(self, run: Run) -> bool:
        """Its worker exited and its record, written since this boot began, is a final one."""
        from fleet.machines import FINAL_STATES, parse_time

        record = self.world.machine_record(run.name) if "event=worker_exit" in run.log() else None
        at = parse_time(record.get("at")) if record else None
        return bool(record and record.get("state") in FINAL_STATES and at and at.timestamp() >= int(run.started))


class FleetRehearsal(Rehearsal):
    """The world: the operator's side (this process: the fake bucket and Compute API on 127.0.0.1, the
    tools) and a `Fleet` of machines, each in namespaces of its own, made by the fake group."""

    def __init__(self, workdir: Path, failing: int = 0):
        super().__init__(workdir, disks=0)
        self.queue = QUEUE
        self.fleet = Fleet(self, failing)
        self.python_release, self.python_downloads = "", Path()  # the stand-in interpreter's host and listing

    def start(self) -> "FleetRehearsal":
        self.gcs = FakeGCS().start()
        self.gcs.create_bucket(BUCKET)
        self.uploader = self.gcs  # the operator's listener
        self.cloud = FakeCloud().start()
        self.cloud.machines = self.fleet
        self.open_project()
        return self

    def stop(self, keep_disks: bool = False) -> None:
        self.fleet.stop_all()
        for server in (self.cloud, self.gcs):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        if not keep_disks:
            remove_in_background([run.disk.path for run in self.fleet.runs if run.disk.path.exists()])

    def listener_gcs(self) -> FakeGCS:
        """A listener on the same bucket, with request counts of its own (one machine's)."""
        listener = FakeGCS()
        listener.storage = self.gcs.storage
        return listener.start()

    def open_project(self) -> None:
        """The project as the pre-flight (fleet/preflight.py) reads it, ready for the fleet: the default
        service account holds roles/compute.instanceAdmin.v1 on the project (to delete itself) and
        roles/storage.objectUser on the bucket, which is in the zone's region; the region has the N2 CPU
        quota for the group; the default subnet has Private Google Access (the machines have no external IP)."""
        cloud, member, region = self.cloud, f"serviceAccount:{SERVICE_ACCOUNT}", ZONE.rsplit("-", 1)[0]
        cloud.add(f"projects/{PROJECT}", {"name": PROJECT, "defaultServiceAccount": SERVICE_ACCOUNT})
        cloud.project_policies[PROJECT] = {"version": 1, "bindings": [
            {"role": "roles/compute.instanceAdmin.v1", "members": [member]}]}
        cloud.buckets[BUCKET] = {"location": region.upper(), "bindings": [
            {"role": "roles/storage.objectUser", "members": [member]}]}
        cloud.set_region(PROJECT, region, {"CPUS": (96, 0), "N2_CPUS": (96, 0)})
        cloud.resources[f"projects/{PROJECT}/regions/{region}"]["zones"] = [f"projects/{PROJECT}/zones/{ZONE}"]
        cloud.add(f"projects/{PROJECT}/zones/{ZONE}/machineTypes/{MACHINE_TYPE}", {"name": MACHINE_TYPE, "guestCpus": 8})
        cloud.add(f"projects/{PROJECT}/regions/{region}/subnetworks/default", {
            "kind": "compute#subnetwork", "name": "default", "region": region, "ipCidrRange": "10.128.0.0/20",
            "network": f"https://www.googleapis.com/compute/v1/projects/{PROJECT}/global/networks/default",
            "privateIpGoogleAccess": True})

    def operator_env(self) -> dict[str, str]:
        """The operator's shell: gcloud and the Python clients pointed at the fakes without credentials
        (tests/cli's way), and uv's interpreter downloads at the stand-in release (`python_release`)."""
        endpoints = dict.fromkeys(("FLEET_COMPUTE_ENDPOINT", "FLEET_TPU_ENDPOINT", "FLEET_CRM_ENDPOINT",
                                   "FLEET_STORAGE_ENDPOINT"), self.cloud.url)
        return {**self.uploader_env(self.workdir), **endpoints, "UV_PYTHON_INSTALL_MIRROR": self.python_release,
                "UV_PYTHON_DOWNLOADS_JSON_URL": self.python_downloads.as_uri()}

    def gcs_spawner(self, *argv: str, timeout: float = 1800) -> Command:
        """`gcs-spawner ARGV` in a process of its own (the console script's module), stdin not a terminal;
        raises RehearsalError unless it exits 0."""
        return run_command(self, [sys.executable, "-m", "gcs_spawner"], list(argv), f"gcs-spawner-{argv[0]}", timeout)

    def machine_record(self, name: str) -> dict | None:
        """machines/NAME.json under the queue as it is now (fleet/machines.py), or None if there is none."""
        key = f"{self.queue.split('/', 3)[3]}/machines/{name}.json"
        stored = self.objects(key).get(key)
        return json.loads(stored.data) if stored is not None else None

    def generations(self, prefix: str) -> dict[str, int]:
        """Each object under `prefix` and its generation (a write makes a new one)."""
        return {name: stored.generation for name, stored in self.objects(prefix).items()}


# -- the operator: a run file, and the `gcs-spawner` command in a process of its own per call


def write_run(directory: Path, job: Path, tasks: Path, model: Path, machines: int) -> Path:
    """The rehearsal's run file: its job and first tasks, the model to mirror, the queue, the code with its
    wheelhouse and interpreter (the machines have no route to the package index), and the fleet: a group of
    `machines` CPU VMs on Debian (the rehearsal's image) without external IPs, with short leases and waits."""
    spec = yaml.safe_load((REPO / "templates" / "vm.yaml").read_text())
    spec.update({"machine_type": MACHINE_TYPE, "accelerator": "cpu", "external_ip": False,
                 "image": "projects/debian-cloud/global/images/family/debian-12",
                 "spawn_flags": ["--on-empty", "delete", "--preemption-watch", "auto", "--lease-ttl", "60",
                                 "--max-attempts", "3", "--idle-timeout", "30", "--job-wait", "60"]})  # fmt: skip
    run = {"name": RUN_NAME, "project": PROJECT, "queue": QUEUE,
           "job": os.path.relpath(job, directory), "tasks": {"file": os.path.relpath(tasks, directory)},
           "model": {"source": os.path.relpath(model, directory)},
           "code": {"url": CODE, "upload": True, "wheelhouse": True, "python_mirror": True},
           "fleet": {"spec": spec, "count": machines, "zones": [ZONE]}}  # fmt: skip
    path = directory / "run.yaml"
    path.write_text("# The fleet rehearsal's run (tests/boot/fleet.py): gcs-spawner up run.yaml --yes, ..., down run.yaml\n"
                    + yaml.safe_dump(run, sort_keys=False, default_flow_style=None))
    return path


# -- the rehearsal


@dataclasses.dataclass
class FleetReport:
    wall_s: float
    tasks: list[str]
    runs: list[Run]
    machines: int
    first_up: Command
    second_up: Command
    late_submit: Command
    down: Command
    merge: Command
    members: list[str]  # the group's members when the first `up` had made it
    code_rewritten: list[str]  # objects under the code prefix the second `up` wrote again
    preempted: str
    late_tasks: list[str]
    recorded: dict[str, str]  # the run's record before `down`: "kind name (where)" -> its state
    recorded_after: dict[str, str]  # ... and after
    view: dict
    index: dict
    deletes: list[str]
    left: list[str]
    done: dict[str, dict]
    failed: int  # members whose boot was refused the code

    def lines(self) -> list[str]:
        out = [f"fleet rehearsal: {len(self.runs)} boots of {len({r.instance for r in self.runs})} instances, "
               f"{len(self.tasks)} tasks ({len(self.late_tasks)} submitted late), wall {self.wall_s:.1f} s, "
               f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)"]  # fmt: skip
        for label, command in (("up", self.first_up), ("up again, mid-run", self.second_up),
                               ("submit --tasks late.jsonl", self.late_submit), ("down", self.down),
                               ("merge", self.merge)):
            steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in command.steps())
            out.append(f"  gcs-spawner {label}: {command.seconds:.1f} s" + (f" ({steps})" if steps else ""))
        rows = []
        for run in self.runs:
            claim = run.first_claim()
            to_claim = f"{claim - run.started:.1f} s" if claim and run.started else "-"
            rows.append([run.name, run.boot, to_claim, run.tasks_done(), run.requests,
                         f"{run.end}{' (refused the code)' if run.refused else ''}: {run.final_record()}"])
        return out + table(["machine", "boot", "boot to first claim", "tasks run", "requests", "end: record"], rows)


def rehearse(workdir: Path, machines: int = 3, first: int = 6, late: int = 2, failed: int = 1,
             timeout: float = 1800) -> FleetReport:
    """The fleet's life, start to end, with a group of `machines` that work and `failed` more whose boot is refused
    the code (tests/boot/machines.refuse_code); raises RehearsalError when a step does not happen in time, or a
    command fails."""
    began = time.monotonic()
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        return _rehearse(workdir, machines, first, late, failed, timeout, began)
    finally:  # this process's storage clients went to the rehearsal's bucket meanwhile
        if emulator is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = emulator


def _recorded(store) -> dict[str, str]:
    from gcs_spawner.record import RunRecord

    return {r.resource.describe(): r.state for r in RunRecord(store).resources()}


def _rehearse(workdir: Path, machines: int, first: int, late: int, failed: int, timeout: float,
              began: float) -> FleetReport:
    from objectstore import open_store
    from reporting.status import snapshot

    if first < machines + failed:
        raise RehearsalError(f"{first} first tasks for {machines} + {failed} machines: the group is as large as the "
                             "tasks, so give at least as many tasks as machines")
    with FleetRehearsal(workdir, failing=failed) as world:
        release, listing = standin_release(world.lower)
        world.python_release, stop_release = release_host(release)
        world.python_downloads = listing
        try:
            job, planned = world.stage_job("fleet", rows=4 * (first + late) // 2, rows_per_task=4, files=2,
                                           upload_model=False)
            lines = planned.read_text().splitlines()
            if len(lines) != first + late:
                raise RehearsalError(f"make_tasks planned {len(lines)} tasks, not {first + late}")
            (workdir / "first.jsonl").write_text("\n".join(lines[:first]) + "\n")
            (workdir / "late.jsonl").write_text("\n".join(lines[first:]) + "\n")
            tasks = [json.loads(line)["id"] for line in lines]
            run_file = str(write_run(workdir, job, workdir / "first.jsonl", job.parent / "model", machines + failed))
            os.environ["STORAGE_EMULATOR_HOST"] = world.gcs.url  # this process's clients: the operator's
            store = open_store(QUEUE)
            fleet = world.fleet

            first_up = world.gcs_spawner("up", run_file, "--yes")
            members = world.cloud.members(GROUP)
            working = wait("a machine working on a task", lambda: next(
                (r for r in list(fleet.runs) if r.ended is None and "event=consumer_start" in r.log()), None), timeout)
            code = world.generations(CODE_PREFIX)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                again = pool.submit(world.gcs_spawner, "up", run_file, "--yes")  # the same command, mid-run
                fleet.preempt(working)  # meanwhile, mid-task: its consumer runs
                wait("a first done marker", lambda: store.list_page("done/").entries, timeout)
                late_submit = world.gcs_spawner("submit", run_file, "--tasks", str(workdir / "late.jsonl"))
                second_up = again.result()
            rewritten = sorted(name for name, generation in world.generations(CODE_PREFIX).items()
                               if code.get(name) != generation)
            wait("every task done and every machine gone", lambda: (
                len(store.list_page("done/").entries) == len(tasks) and not world.cloud.members(GROUP)
                and all(r.ended for r in list(fleet.runs))), timeout)  # fmt: skip
            recorded = _recorded(store)
            down = world.gcs_spawner("down", run_file)  # no --yes: it goes on only if status says complete
            view = snapshot(store)
            recorded_after = _recorded(store)
            merge = world.gcs_spawner("merge", run_file)
        finally:
            stop_release()
        index = json.loads(store.read("index.json").data)
        deletes = [member for call in world.cloud.calls("POST", "/deleteInstances") for member in call.body["instances"]]
        left = sorted(k for k in world.cloud.resources if re.search(r"/(instances|instanceGroupManagers|instanceTemplates)/", k))
        done = {e.name: json.loads(store.read(e.name).data) for e in store.list("done/")}
        for run in fleet.runs:
            run.count_requests()
        return FleetReport(time.monotonic() - began, tasks, list(fleet.runs), machines + failed, first_up, second_up,
                           late_submit, down, merge, members, rewritten, working.name, tasks[first:], recorded,
                           recorded_after, view, index, deletes, left, done, failed)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.boot.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=3, help="the group's working machines (default 3)")
    parser.add_argument("--failed", type=int, default=1,
                        help="more members, whose first boot is refused the code: a failed boot each (default 1)")
    parser.add_argument("--tasks", type=int, default=6, help="tasks submitted by `up` (default 6)")
    parser.add_argument("--late", type=int, default=2, help="tasks submitted once the first is done (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (disks, consoles, logs)")
    args = parser.parse_args(argv)
    return drive("fleet rehearsal", args.keep,
                 lambda workdir: rehearse(workdir, args.machines, args.tasks, args.late, args.failed), check)


def check(report: FleetReport) -> list[str]:
    """What must be true of a fleet's life (issue 36), driven by `gcs-spawner`; each failure as a line (none: all held)."""
    problems = []
    expected = {f"done/{t}.json" for t in report.tasks}
    if set(report.done) != expected:
        problems.append(f"done markers {sorted(report.done)} are not one per task {sorted(expected)}")
    if sum(run.tasks_done() for run in report.runs) != len(report.tasks):
        problems.append(f"the machines ran {sum(r.tasks_done() for r in report.runs)} tasks to done, not {len(report.tasks)}")
    totals = report.index.get("totals", {})
    if totals.get("tasks") != len(report.tasks) or {s["task"] for s in report.index.get("shards", [])} != set(report.tasks):
        problems.append(f"the merged index is not complete: totals {totals}")
    # `up`: the pre-flight against the fakes, then the template and the group, once; the tasks, once.
    first, again = report.first_up, report.second_up
    made = [f"instance_template {RUN_NAME} (global)", f"instance_group {RUN_NAME} ({ZONE})"]
    first_tasks = len(report.tasks) - len(report.late_tasks)
    preflight = re.findall(r"^preflight (\S+) +(\S+):", first.stdout, flags=re.MULTILINE)
    if not preflight or any(status != "ok" for status, _ in preflight):
        problems.append(f"the pre-flight did not find everything in place: {preflight}")
    if first.created() != made or [(m, p.rsplit("/", 1)[1]) for m, p in first.creates()] != [
            ("POST", "instanceTemplates"), ("POST", "instanceGroupManagers")]:
        problems.append(f"up said it made {first.created()} and sent {first.creates()}: the template, then the group expected")
    if [e.get("created") for e in first.events("submitted")] != [str(first_tasks)]:
        problems.append(f"up submitted {first.events('submitted')}, not the {first_tasks} tasks of the run")
    # The same `up` again, mid-run: it finds everything and creates nothing (its words, its record, the API).
    summary = re.search(r"\((\d+) resources? created now, (\d+) there already\)", again.stdout)  # "1 resource"
    if (again.created() or again.creates() or not summary or summary.groups() != ("0", str(len(made)))
            or [e.get("created") for e in again.events("submitted")] != ["0"] or report.code_rewritten):  # fmt: skip
        problems.append(f"the second up created {again.created()}, sent {again.creates()}, said "
                        f"{summary.group(0) if summary else again.stdout[-500:]!r}, submitted {again.events('submitted')}, "
                        f"rewrote {report.code_rewritten[:10]} of the code: it should make nothing")
    instances = {r.instance for r in report.runs}
    if len(report.members) != report.machines or instances != set(report.members):
        problems.append(f"instances {sorted(instances)} were booted; the group up made had {report.members} "
                        f"({report.machines} expected), and nothing else should have been made")
    recreated = [r for r in report.runs if r.name == report.preempted and r.boot == 2]
    if not recreated:
        problems.append(f"the group did not recreate the preempted {report.preempted}")
    preempted = next(r for r in report.runs if r.name == report.preempted and r.boot == 1)
    if "event=preempted key=instance/preempted" not in preempted.log() or preempted.end != "preempted":
        problems.append(f"{report.preempted} did not see its preemption: {preempted.log()[-1500:]}")
    if sorted(report.deletes) != sorted(f"zones/{ZONE}/instances/{name}" for name in {r.name for r in report.runs}):
        problems.append(f"deleteInstances named {sorted(report.deletes)}: one per machine expected")
    if any(r.end != "deleted" for r in report.runs if r.end != "preempted"):
        problems.append(f"machines that did not end by their own delete: {[(r.name, r.boot, r.end) for r in report.runs]}")
    # `down`: exactly what up recorded, each once, group before template; nothing of the kinds left.
    if sorted(report.recorded) != sorted(made) or set(report.recorded.values()) != {"created"}:
        problems.append(f"the run's record before down was {report.recorded}, not {made} created")
    wanted = [("DELETE", GROUP), ("DELETE", TEMPLATE)]  # what the record holds (checked above), group first
    sent = [(method, path.split("/compute/v1/", 1)[-1]) for method, path in report.down.mutations]
    if sent != wanted or report.recorded_after != dict.fromkeys(made, "deleted"):
        problems.append(f"down sent {sent} (expected {wanted}) and left the record {report.recorded_after}")
    # Every boot's last record says how it ended (tests/boot/records.py): self-deleted, preempted, or,
    # for the machine its group recreated, its own boot's self-delete (not the preempted boot's record).
    # A boot refused the code must say so: `failed`, its phase and the refusal in the reason, and it deleted
    # itself (its deleteInstances is among those checked above).
    endings = {"deleted": records.SELF_DELETED, "preempted": records.PREEMPTED}
    problems += records.problems([
        records.Ending(r.name, r.boot, records.FAILED_BOOT if r.refused else endings[r.end], r.record, r.started,
                       r.ended or time.time(), records.CODE_REFUSED if r.refused else None)
        for r in report.runs if r.end in endings])  # fmt: skip
    refused = [r for r in report.runs if r.refused]
    if len(refused) != report.failed or any(r.tasks_done() or r.first_claim() for r in refused):
        problems.append(f"failed boots {[(r.name, r.end, r.final_record()) for r in refused]}: {report.failed} "
                        "expected, none claiming")
    if report.left:
        problems.append(f"teardown left {report.left}")
    if not report.view.get("complete"):
        problems.append("status does not say complete")
    return problems


if __name__ == "__main__":
    sys.exit(main())
