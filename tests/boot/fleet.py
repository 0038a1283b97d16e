"""The whole fleet, rehearsed: a managed instance group of rehearsal machines on the tiny model, from
`up` to `down`, with a preemption, a second `up`, a late submit, and every machine deleting itself.

    sudo .venv/bin/python -m tests.boot.fleet [--machines 3] [--tasks 6] [--late 2] [--keep]
    make rehearsal                                    # the same, with its defaults

What is real and what stands in is the boot rehearsal's (tests/boot/rehearsal.py, docs/CLOUD.md "The
boot, rehearsed"), per machine: the cached Debian root filesystem in namespaces of its own (network:
loopback only; PID and mount), the real startup/startup.sh from its own metadata server at
169.254.169.254:80, the real gcloud and uv, the code and wheels the real tools/upload_code.py put in the
bucket, spawn.py and consume.py extracting with the tiny model. What this adds is the fleet around them:

- the fake Compute API (tests/cloud/fakecloud.py) keeps a managed instance group's members, made from
  the instance template the real fleet.launch.create_template sent, and hands each member it creates
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
  on a new boot disk.

`up` and `down` are one small function each (`up`, `down`), driven by the existing tools until the
one-command CLI lands (issue 35: `gcs-spawner up`/`down`): submit with the real tools/submit.py, the
template and the group with fleet.launch, teardown with fleet.launch.teardown. `down` waits for the
completion rule first (taskqueue/completion.py, through reporting.status.snapshot).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.boot.rehearsal import (
    BUCKET, METADATA_ADDRESS, PROJECT, REPO, ZONE, Disk, Namespaces, Rehearsal, RehearsalError, instance_metadata,
    machine_env, prepare_disk, release_host, remove_in_background, standin_release,
)  # fmt: skip
from tests.cloud.fakecloud import FakeCloud
from tests.cloud.fakehttp import Listener
from tests.cloud.fakemetadata import FakeMetadata
from tests.fakegcs.server import FakeGCS

NAME = "spawn-worker"  # the template's and the group's name, as templates/vm.yaml has it
CODE = "code/fleet"
QUEUE = f"gs://{BUCKET}/jobs/fleet"
GROUP = f"projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/{NAME}"
SHUTDOWN_S = 3.0  # from a delete request to the machine's end (a guest shutdown's stand-in)
PREEMPTION_NOTICE_S = 30.0  # Compute Engine's: at most this long from the notice to the stop


@dataclasses.dataclass
class Run:
    """One boot of one instance: its disk, namespaces, metadata server and listeners, and how it went."""

    instance: str
    boot: int
    disk: Disk
    started: float = 0.0  # epoch seconds, when the startup-script runner began
    ended: float | None = None
    end: str = ""  # why it stopped: deleted (through the API), preempted, still up
    console: str = ""
    ns: Namespaces | None = None
    metadata: FakeMetadata | None = None
    gcs: FakeGCS | None = None
    api: Listener | None = None
    thread: threading.Thread | None = None
    requests: int = 0
    saved_log: str | None = None  # the worker's log as the machine ended (its disk goes afterwards)

    @property
    def name(self) -> str:
        return self.instance.rsplit("/", 1)[1]

    def log(self) -> str:
        """The worker's log (the journal's stand-in), read from the disk's upper layer, up or not."""
        if self.saved_log is not None:
            return self.saved_log
        path = self.disk.path / "upper/var/log/spawn-worker.service.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def first_claim(self) -> float | None:
        """Epoch seconds of its first claim: the fencing token is the lease's generation, which the
        fake GCS takes from the clock in microseconds (tests/boot/rehearsal.first_claim_time)."""
        tokens = [int(t) / 1e6 for t in re.findall(r"event=claimed task=\S+ token=(\d+)", self.log())]
        return min(tokens, default=None)

    def tasks_done(self) -> int:
        return len(re.findall(r"event=done task=", self.log()))

    def count_requests(self) -> int:
        """Requests this machine sent: to the bucket, the Compute/TPU/IAM APIs and its metadata server."""
        if self.gcs is not None:
            self.requests = (sum(self.gcs.counts().values()) + (self.api.served if self.api else 0)
                             + (len(self.metadata.requests) if self.metadata else 0))  # fmt: skip
        return self.requests


class Fleet:
    """Boots what the fake Compute API creates (tests/cloud/fakecloud.Machines), each instance a
    rehearsal machine of its own, and shuts down what it deletes."""

    def __init__(self, world: "FleetRehearsal"):
        self.world = world
        self.lock = threading.Lock()
        self.runs: list[Run] = []

    # -- what the fake Compute API calls (with its lock held: start work, never wait for it)

    def created(self, instance: str, resource: dict) -> None:
        with self.lock:
            boot = 1 + sum(r.instance == instance for r in self.runs)
            run = Run(instance, boot, Disk(self.world.workdir / f"{instance.rsplit('/', 1)[1]}-boot{boot}"))
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
        try:
            run.ns = Namespaces(self.world.lower, [run.disk]).start()
            run.metadata = run.ns.in_netns(lambda: FakeMetadata(values).start(METADATA_ADDRESS))
            run.gcs = run.ns.in_netns(lambda: self.world.listener_gcs())
            run.api = run.ns.in_netns(lambda: self.world.cloud.listen())
            prepare_disk(run.ns.view(run.disk), run.gcs.url, run.api.url)
            run.started = time.time()
            result = run.ns.run(run.disk, ["/usr/local/sbin/google-startup-script"], machine_env(run.gcs.url, run.api.url),
                                timeout=3600)
            run.console = result.stdout + result.stderr
        except Exception as err:  # noqa: BLE001 - a machine halted mid-boot, or one that never came up: on record
            run.console += f"\nrehearsal: the boot ended: {type(err).__name__}: {err}"
        (self.world.workdir / f"console-{run.name}-boot{run.boot}.log").write_text(run.console)

    def halt(self, run: Run, why: str) -> None:
        """The machine stops: every process in its namespaces dies; its worker's log and request count
        are kept (its disk is removed with the rehearsal)."""
        with self.lock:
            if run.ended is not None:
                return
            run.ended, run.end = time.time(), why
        if run.ns is not None:
            run.ns.stop()
        run.count_requests()
        run.saved_log = run.log()
        (self.world.workdir / f"worker-{run.name}-boot{run.boot}.log").write_text(run.saved_log)
        for server in (run.metadata, run.gcs, run.api):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()

    def preempt(self, run: Run) -> None:
        """A spot VM's preemption: the notice, up to PREEMPTION_NOTICE_S for the worker to hand its task
        back (it exits once it has), the stop, then the group's repair (FakeCloud.stopped)."""
        run.metadata.set("instance/preempted", "TRUE")
        deadline = time.monotonic() + PREEMPTION_NOTICE_S
        while time.monotonic() < deadline and "event=worker_exit" not in run.log():
            time.sleep(0.5)
        self.halt(run, "preempted")
        self.world.cloud.stopped(run.instance)

    def stop_all(self) -> None:
        with self.lock:
            runs = [r for r in self.runs if r.ended is None]
        for run in runs:
            self.halt(run, "still up at the end")


class FleetRehearsal(Rehearsal):
    """The world: the operator's side (this process: the fake bucket and Compute API on 127.0.0.1, the
    tools) and a `Fleet` of machines, each in namespaces of its own, made by the fake group."""

    def __init__(self, workdir: Path):
        super().__init__(workdir, disks=0)
        self.fleet = Fleet(self)

    def start(self) -> "FleetRehearsal":
        self.gcs = FakeGCS().start()
        self.gcs.create_bucket(BUCKET)
        self.uploader = self.gcs  # the operator's listener
        self.cloud = FakeCloud().start()
        self.cloud.machines = self.fleet
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

    def compute_clients(self):
        from google.auth.credentials import AnonymousCredentials

        from fleet import compute

        return compute.ComputeClients.connect(client_options={"api_endpoint": self.cloud.url},
                                              credentials=AnonymousCredentials(), transport="rest")  # fmt: skip


# -- the operator's two commands (issue 35 brings `gcs-spawner up` / `down`; until then, the tools)


def up(world: FleetRehearsal, spec: Path, job: Path, tasks: Path, size: int) -> list[str]:
    """Submit (idempotent: tools/submit.py), then the template and the group (fleet.launch) unless they
    exist. Returns what it created: a second `up` during the run creates nothing."""
    from fleet import gapi, launch

    world.tool("tools/submit.py", QUEUE, "--job", str(job), "--tasks", str(tasks))
    clients = world.compute_clients()
    made = []
    steps: list[tuple[str, Callable[[], object]]] = [
        ("template", lambda: launch.create_template(spec, PROJECT, QUEUE, f"gs://{BUCKET}/{CODE}", clients=clients)),
        ("group", lambda: launch.create_group(PROJECT, NAME, size, zone=ZONE, clients=clients)),
    ]
    for what, step in steps:
        try:
            step()
            made.append(what)
        except gapi.LaunchError as err:
            if "already exists" not in str(err):
                raise
    return made


def down(world: FleetRehearsal, timeout: float) -> dict:
    """Wait until the queue is complete by the completion rule (status's), then delete the group and
    the template (fleet.launch.teardown). Returns status's last view."""
    from fleet import launch
    from objectstore import open_store
    from reporting.status import snapshot

    store = open_store(QUEUE)
    deadline = time.monotonic() + timeout
    view = snapshot(store)
    while not view["complete"]:
        if time.monotonic() > deadline:
            raise RehearsalError(f"the queue is not complete after {timeout:.0f} s: {json.dumps(view['blockers'])[:2000]}")
        time.sleep(2)
        view = snapshot(store)
    launch.teardown(PROJECT, zone=ZONE, group=NAME, template=NAME, compute_clients=world.compute_clients())
    return view


# -- the rehearsal


@dataclasses.dataclass
class FleetReport:
    wall_s: float
    upload_s: float
    tasks: list[str]
    runs: list[Run]
    made_first: list[str]
    made_again: list[str]
    preempted: str
    members_after_second_up: int
    late_tasks: list[str]
    view: dict
    index: dict
    deletes: list[str]
    left: list[str]
    done: dict[str, dict]

    def lines(self) -> list[str]:
        out = [f"fleet rehearsal: {len(self.runs)} boots of {len({r.instance for r in self.runs})} instances, "
               f"{len(self.tasks)} tasks ({len(self.late_tasks)} submitted late), wall {self.wall_s:.1f} s "
               f"(upload {self.upload_s:.1f} s), load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)"]  # fmt: skip
        out.append(f"  {'machine':24s} {'boot':>4s} {'boot to first claim':>20s} {'tasks run':>9s} {'requests':>8s}  end")
        for run in self.runs:
            claim = run.first_claim()
            to_claim = f"{claim - run.started:.1f} s" if claim and run.started else "-"
            out.append(f"  {run.name:24s} {run.boot:4d} {to_claim:>20s} {run.tasks_done():9d} {run.requests:8d}  {run.end}")
        return out


def _wait(what: str, check: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise RehearsalError(f"timed out after {timeout:.0f} s waiting for {what}")


def write_spec(directory: Path) -> Path:
    """templates/vm.yaml as a CPU worker on Debian (the rehearsal's image), with short leases and waits."""
    raw = yaml.safe_load((REPO / "templates" / "vm.yaml").read_text())
    raw.update({"machine_type": "n2-standard-8", "accelerator": "cpu", "image": "projects/debian-cloud/global/images/family/debian-12",
                "spawn_flags": ["--on-empty", "delete", "--preemption-watch", "auto", "--lease-ttl", "60",
                                "--max-attempts", "3", "--idle-timeout", "30", "--job-wait", "60"]})  # fmt: skip
    path = directory / "fleet-vm.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def rehearse(workdir: Path, machines: int = 3, first: int = 6, late: int = 2, timeout: float = 1800) -> FleetReport:
    """The fleet's life, start to end; raises RehearsalError when a step does not happen in time."""
    began = time.monotonic()
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        return _rehearse(workdir, machines, first, late, timeout, began)
    finally:  # this process's storage clients went to the rehearsal's bucket meanwhile
        if emulator is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = emulator


def _rehearse(workdir: Path, machines: int, first: int, late: int, timeout: float, began: float) -> FleetReport:
    from objectstore import open_store

    with FleetRehearsal(workdir) as world:
        release, listing = standin_release(world.lower)
        url, stop_release = release_host(release)
        try:
            upload_s = world.upload_code(CODE, url, listing)
        finally:
            stop_release()
        job, planned = world.stage_job("fleet", rows=4 * (first + late) // 2, rows_per_task=4, files=2)
        lines = planned.read_text().splitlines()
        if len(lines) != first + late:
            raise RehearsalError(f"make_tasks planned {len(lines)} tasks, not {first + late}")
        (workdir / "first.jsonl").write_text("\n".join(lines[:first]) + "\n")
        (workdir / "late.jsonl").write_text("\n".join(lines[first:]) + "\n")
        tasks = [json.loads(line)["id"] for line in lines]
        spec = write_spec(workdir)
        os.environ["STORAGE_EMULATOR_HOST"] = world.gcs.url  # this process's clients: the operator's
        store = open_store(QUEUE)
        fleet = world.fleet

        made_first = up(world, spec, job, workdir / "first.jsonl", machines)
        working = _wait("a machine working on a task", lambda: next(
            (r for r in list(fleet.runs) if r.ended is None and "event=consumer_start" in r.log()), None), timeout)
        made_again = up(world, spec, job, workdir / "first.jsonl", machines)  # a second `up`, mid-run
        members = len(world.cloud.members(GROUP))
        fleet.preempt(working)  # mid-task: its consumer runs
        _wait("a first done marker", lambda: store.list_page("done/").entries, timeout)
        world.tool("tools/submit.py", QUEUE, "--tasks", str(workdir / "late.jsonl"))  # a late submit
        _wait("every task done and every machine gone", lambda: (
            len(store.list_page("done/").entries) == len(tasks) and not world.cloud.members(GROUP)
            and all(r.ended for r in list(fleet.runs))), timeout)  # fmt: skip
        view = down(world, timeout=120)
        world.tool("tools/merge.py", QUEUE)
        index = json.loads(store.read("index.json").data)
        deletes = [member for call in world.cloud.calls("POST", "/deleteInstances") for member in call.body["instances"]]
        left = sorted(k for k in world.cloud.resources if re.search(r"/(instances|instanceGroupManagers|instanceTemplates)/", k))
        done = {e.name: json.loads(store.read(e.name).data) for e in store.list("done/")}
        for run in fleet.runs:
            run.count_requests()
        return FleetReport(time.monotonic() - began, upload_s, tasks, list(fleet.runs), made_first, made_again,
                           working.name, members, tasks[first:], view, index, deletes, left, done)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.boot.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=3, help="the group's size (default 3)")
    parser.add_argument("--tasks", type=int, default=6, help="tasks submitted by `up` (default 6)")
    parser.add_argument("--late", type=int, default=2, help="tasks submitted once the first is done (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (disks, consoles, logs)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="fleet-rehearsal-"))
    try:
        report = rehearse(workdir, args.machines, args.tasks, args.late)
    except RehearsalError as err:
        print(f"fleet rehearsal failed: {err} (consoles and logs: {workdir})", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    problems = check(report)
    for problem in problems:
        print(f"PROBLEM {problem}")
    if problems or args.keep:
        print(f"consoles and logs: {workdir}")
    else:
        remove_in_background([workdir])  # gigabytes of disks: the shell need not wait for them
    return 1 if problems else 0


def check(report: FleetReport) -> list[str]:
    """What must be true of a fleet's life (issue 36); each failure as a line (none: all held)."""
    problems = []
    expected = {f"done/{t}.json" for t in report.tasks}
    if set(report.done) != expected:
        problems.append(f"done markers {sorted(report.done)} are not one per task {sorted(expected)}")
    if sum(run.tasks_done() for run in report.runs) != len(report.tasks):
        problems.append(f"the machines ran {sum(r.tasks_done() for r in report.runs)} tasks to done, not {len(report.tasks)}")
    totals = report.index.get("totals", {})
    if totals.get("tasks") != len(report.tasks) or {s["task"] for s in report.index.get("shards", [])} != set(report.tasks):
        problems.append(f"the merged index is not complete: totals {totals}")
    if report.made_first != ["template", "group"] or report.made_again != []:
        problems.append(f"up made {report.made_first}, the second up {report.made_again} (expected nothing)")
    instances = {r.instance for r in report.runs}
    if report.members_after_second_up != len([r for r in report.runs if r.boot == 1]) or len(instances) != report.members_after_second_up:
        problems.append(f"{len(instances)} instances were made, the group had {report.members_after_second_up} after the second up")
    recreated = [r for r in report.runs if r.name == report.preempted and r.boot == 2]
    if not recreated:
        problems.append(f"the group did not recreate the preempted {report.preempted}")
    first = next(r for r in report.runs if r.name == report.preempted and r.boot == 1)
    if "event=preempted key=instance/preempted" not in first.log() or first.end != "preempted":
        problems.append(f"{report.preempted} did not see its preemption: {first.log()[-1500:]}")
    if sorted(report.deletes) != sorted(f"zones/{ZONE}/instances/{name}" for name in {r.name for r in report.runs}):
        problems.append(f"deleteInstances named {sorted(report.deletes)}: one per machine expected")
    if any(r.end != "deleted" for r in report.runs if r.end != "preempted"):
        problems.append(f"machines that did not end by their own delete: {[(r.name, r.boot, r.end) for r in report.runs]}")
    if report.left:
        problems.append(f"teardown left {report.left}")
    if not report.view.get("complete"):
        problems.append("status does not say complete")
    return problems


if __name__ == "__main__":
    sys.exit(main())
