"""What the two fleet rehearsals share (tests/boot/fleet.py: a VM group; tests/boot/tpu_fleet.py: TPU slices):
one boot of one rehearsal machine and how it ended, the booting and halting of such boots, a failed boot on
purpose, the operator's commands in processes of their own, and the per-machine table a report prints.

A boot here is the boot rehearsal's machine (tests/boot/rehearsal.py): a disk of its own on the cached root
filesystem, namespaces of its own, its own metadata server at 169.254.169.254:80 and its own listeners on the
rehearsal's bucket and cloud APIs (so its request counts are its own), and the real startup.sh run by the guest
agent's stand-in. Whichever fake made it (a managed instance group's member, a TPU node's host) hands it here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tests.boot import rootfs
from tests.boot.rehearsal import (
    METADATA_ADDRESS, REPO, Disk, Namespaces, RehearsalError, machine_env, prepare_disk, remove_in_background,
    tools_verdict,
)  # fmt: skip
from tests.cloud.fakemetadata import FakeMetadata
from tests.fakegcs.server import FakeGCS

if TYPE_CHECKING:
    from tests.boot.fleet import FleetRehearsal

#: A lease taken, in a worker's log: a claim, or a takeover of a released or expired lease (taskqueue/claims.py).
CLAIM = r"event=(?:claimed|takeover|steal) task="
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def log_time(line: str) -> float | None:
    """Epoch seconds of a log line (`logging`'s asctime, this machine's local time)."""
    match = LOG_TIME.match(line)
    if not match:
        return None
    return time.mktime(time.strptime(match.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + int(match.group(1)[20:]) / 1e3


def first_event(log: str, pattern: str) -> float | None:
    for line in log.splitlines():
        if re.search(pattern, line):
            at = log_time(line)
            if at is not None:
                return at
    return None


def wait(what: str, check: Callable[[], object], timeout: float) -> object:
    """`check()`'s first true value, polled each second; RehearsalError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1)
    raise RehearsalError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclasses.dataclass
class MachineBoot:
    """One boot of one machine: its disk, namespaces, metadata server and listeners, and how it went. `name`
    is the machine record's name (machines/<name>.json), which is also the machine's own name."""

    name: str
    disk: Disk
    started: float = 0.0  # epoch seconds, when the startup-script runner began
    ended: float | None = None
    end: str = ""  # why it stopped, in the rehearsal's words
    refused: bool = False  # its bucket listener refuses the code (a failed boot on purpose: `refuse_code`)
    console: str = ""
    ns: Namespaces | None = None
    metadata: FakeMetadata | None = None
    gcs: FakeGCS | None = None
    api: object | None = None  # the cloud APIs' listener (tests/cloud/fakehttp.Listener)
    thread: threading.Thread | None = None
    requests: int = 0
    saved_log: str | None = None  # the worker's log as the machine ended (its disk goes afterwards)
    record: dict | None = None  # its machine record as it stopped (a machine made again under its name overwrites it)

    def log(self) -> str:
        """The worker's log (the journal's stand-in), read from the disk's upper layer, up or not."""
        if self.saved_log is not None:
            return self.saved_log
        path = self.disk.path / "upper/var/log/spawn-worker.service.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def first_claim(self) -> float | None:
        """Epoch seconds of its first claim: the fencing token is the lease's generation, which the fake GCS
        takes from the clock in microseconds (tests/boot/rehearsal.first_claim_time)."""
        tokens = [int(t) / 1e6 for t in re.findall(CLAIM + r"\S+ token=(\d+)", self.log())]
        return min(tokens, default=None)

    def tasks_done(self) -> int:
        return len(re.findall(r"event=done task=", self.log()))

    def count_requests(self) -> int:
        """Requests this machine sent: to the bucket, the Compute/TPU/IAM APIs and its metadata server."""
        if self.gcs is not None:
            self.requests = (sum(self.gcs.counts().values()) + (self.api.served if self.api else 0)
                             + (len(self.metadata.requests) if self.metadata else 0))  # fmt: skip
        return self.requests

    def final_record(self) -> str:
        record = self.record
        return f"{record.get('state')} ({record.get('reason', '')})" if record else "none"


#: The prefix of the code in the bucket that a refused boot may not read (both rehearsals upload under code/).
CODE_PREFIX = "code/"


def refuse_code(listener: FakeGCS) -> None:
    """A failed boot on purpose: this machine's bucket listener answers 403 to every request for the code, as
    Cloud Storage answers a service account without roles/storage.objectViewer there
    (https://cloud.google.com/storage/docs/troubleshooting, "403: Forbidden"). Its code sync fails; startup.sh
    must record `failed` with `code_sync_failed: permission denied: ...` and delete the machine. The queue stays
    open to it, so the record can be written (one machine's listener: the others are not touched)."""
    listener.faults.fail_fraction(1.0, 403, name_prefix=CODE_PREFIX)


class Machines:
    """Boots and halts the machines of a fleet rehearsal (its `world`: the fakes, the root filesystem, the work
    directory); a subclass takes what its fake API makes and says which machines to boot."""

    def __init__(self, world: FleetRehearsal):
        self.world = world
        self.lock = threading.Lock()
        self.boots: list[MachineBoot] = []

    def boot(self, machine: MachineBoot, values: dict[str, str], namespaces: Callable[[], Namespaces],
             wire: Callable[[MachineBoot], None] = lambda machine: None) -> None:
        """Boot `machine` on this thread: its namespaces (`namespaces()` makes them), `wire(machine)` (a network
        between machines, names in /etc/hosts), its metadata server with `values`, its listeners, then the
        startup-script runner until it returns; the console is kept as console-<name>-<n>.log."""
        try:
            machine.ns = namespaces().start()
            machine.metadata = machine.ns.in_netns(lambda: FakeMetadata(values).start(METADATA_ADDRESS))
            machine.gcs = machine.ns.in_netns(lambda: self.world.listener_gcs())
            if machine.refused:
                refuse_code(machine.gcs)
            machine.api = machine.ns.in_netns(lambda: self.world.cloud.listen())
            prepare_disk(machine.ns.view(machine.disk), machine.gcs.url, machine.api.url)
            wire(machine)
            machine.started = time.time()
            result = machine.ns.run(machine.disk, ["/usr/local/sbin/google-startup-script"],
                                    machine_env(machine.gcs.url, machine.api.url), timeout=3600)
            machine.console = result.stdout + result.stderr
        except Exception as err:  # noqa: BLE001 - a machine halted mid-boot, or one that never came up: on record
            machine.console += f"\nrehearsal: the boot ended: {type(err).__name__}: {err}"
        (self.world.workdir / f"console-{machine.disk.path.name}.log").write_text(machine.console)

    def halt(self, machine: MachineBoot, why: str) -> None:
        """The machine stops: every process in its namespaces dies (SIGKILL); its record as it stopped, its
        worker's log and its request count are kept (its disk is removed with the rehearsal)."""
        with self.lock:
            if machine.ended is not None:
                return
            machine.ended, machine.end = time.time(), why
        if machine.ns is not None:
            machine.ns.stop()
        machine.record = self.world.machine_record(machine.name)  # before a machine made again under its name writes
        machine.count_requests()
        machine.saved_log = machine.log()
        (self.world.workdir / f"worker-{machine.disk.path.name}.log").write_text(machine.saved_log)
        for server in (machine.metadata, machine.gcs, machine.api):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()

    def stop_all(self) -> None:
        with self.lock:
            running = [m for m in self.boots if m.ended is None]
        for machine in running:
            self.halt(machine, "still up at the end")


@dataclasses.dataclass
class Command:
    """One `gcs-spawner` command as the operator ran it, and what the fake Compute API received meanwhile."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    started: float  # epoch seconds
    seconds: float
    mutations: list[tuple[str, str]]  # (method, path) of every request but a GET the fake API took while it ran

    def events(self, event: str) -> list[dict[str, str]]:
        """Its `event=EVENT key=value ...` log lines (stderr is no terminal, so the log is at INFO)."""
        found = []
        for line in self.stderr.splitlines():
            fields = dict(field.split("=", 1) for field in line.split() if "=" in field)
            if fields.get("event") == event:
                found.append(fields)
        return found

    def created(self) -> list[str]:
        """The resources it says it created (`event=created resource=KIND NAME (WHERE)`), in order."""
        return re.findall(r"event=created resource=(.+)$", self.stderr, flags=re.MULTILINE)

    def creates(self) -> list[tuple[str, str]]:
        """Requests in its window that make or grow something: an insert of a template, a group, an
        instance, a TPU node or queued resource, or a group's resize (the machines send none of these)."""
        return [(method, path) for method, path in self.mutations if method == "POST" and (
            re.search(r"/(instanceTemplates|instanceGroupManagers|instances|nodes|queuedResources)$", path)
            or path.endswith("/resize"))]  # fmt: skip

    def steps(self) -> list[tuple[str, float]]:
        """`up`'s steps and the seconds each took, from its `event=step_done` lines' timestamps."""
        out, previous = [], self.started
        for line in self.stderr.splitlines():
            match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*event=step_done step=(\S+)", line)
            if match:
                at = time.mktime(time.strptime(match.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + int(match.group(1)[20:]) / 1e3
                out.append((match.group(2), at - previous))
                previous = at
        return out


def run_command(world: FleetRehearsal, program: list[str], argv: list[str], label: str,
                timeout: float = 1800) -> Command:
    """The operator's command (`program`, e.g. the interpreter and `-m gcs_spawner`, then `argv`) in a process of
    its own, stdin not a terminal, in the operator's environment (`world.operator_env()`); its output is kept as
    <label>-<start>.log. Raises RehearsalError unless it exits 0."""
    before = len(world.cloud.mutations())
    started, clock = time.time(), time.monotonic()
    result = subprocess.run([*program, *argv], cwd=REPO, env=world.operator_env(), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=timeout)
    command = Command(list(argv), result.returncode, result.stdout, result.stderr, started,
                      time.monotonic() - clock, world.cloud.mutations()[before:])
    (world.workdir / f"{label}-{started:.0f}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RehearsalError(f"{' '.join([*program[1:], *argv])} exited {result.returncode}:\n"
                             f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return command

def table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Rows under their headers, each column as wide as its widest cell; the last column left as it is, the
    first left-aligned, the others right-aligned (figures)."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    out = []
    for row in [headers, *rows]:
        cells = [str(cell) for cell in row]
        line = [cells[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(cells[1:-1], widths[1:-1])), cells[-1]]
        out.append(indent + "  ".join(line).rstrip())
    return out


def drive(what: str, keep: bool, rehearse: Callable[[Path], object], checks: Callable[[object], list[str]]) -> int:
    """A rehearsal as a command (`make rehearsal`, `make rehearsal-tpu`): `rehearse(workdir)` gives a report whose
    `lines()` are printed, then each of `checks(report)` as a PROBLEM line; exit 1 on any. A machine that cannot
    get the tools (no root, apt's lock held, no namespaces) says why in one line and skips (exit 0), or fails
    where CI requires the rehearsal: never a RootfsError traceback. The work directory (gigabytes of disks) is
    removed in the background unless kept or something failed."""
    verdict = tools_verdict()
    if verdict is not None:
        message, fails = verdict
        print(f"{what} {'failed' if fails else 'skipped'}: {message}", file=sys.stderr)
        return 1 if fails else 0
    workdir = Path(tempfile.mkdtemp(prefix=f"{what.lower().replace(' ', '-')}-"))
    try:
        report = rehearse(workdir)
    except (RehearsalError, rootfs.RootfsError) as err:
        print(f"{what} failed: {err} (consoles and logs: {workdir})", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    problems = checks(report)
    for problem in problems:
        print(f"PROBLEM {problem}")
    if problems or keep:
        print(f"consoles and logs: {workdir}")
    else:
        remove_in_background([workdir])  # the shell need not wait for them
    return 1 if problems else 0
